#!/usr/bin/env bash
# Issue 33, last step (DeepEP's buffer owned by an EPTransport; the package cut to its line budget):
# every GPU test on HEAD, then bench_pipeline 0.8B batch 1 and 64 before ($BEFORE, an export of
# d4ae7c3, this session's start) and after (the working tree), alternating. PART=tests | pipe.
source .whl/gpu-env.sh
for d in _gpu/*/lmdeploy_lite; do [ -d $d/assets ] || cp -r lmdeploy_lite/assets $d/; done   # exports lack the model
export PYTHONPATH=/tmp/site:$PWD
T="python3 -m pytest -q -p no:cacheprovider -rs -x"
F="grep -v ^USDT\|IBGDA\|^$\|warn"
if [ "${PART:-tests}" = tests ]; then
  timeout 280 $T tests/gpu --ignore=tests/gpu/test_multi_gpu_graphs.py 2>&1 | $F | tail -6
  timeout 300 $T -s tests/gpu/test_multi_gpu_graphs.py -k "not four_gpus" tests/pytorch/test_deepep_dispatcher.py 2>&1 | $F | grep "replays\|identical\|passed\|failed\|Error" | tail -14
else
  AFTER=. BEFORE=${BEFORE:-_gpu/before} PART=pipe bash benchmarks/gpu_run_33b.sh
fi

#!/usr/bin/env bash
# Issue 33 on 2 x H100: every GPU test against the refactored code (EngineClient, build_engine,
# typed group handles): the one-GPU tests, then the two-GPU, DeepEP and multi-GPU graph tests.
# Runs from $CODE (default: the working tree), a clean export of the commit under test.
source .whl/gpu-env.sh
for d in _gpu/*/lmdeploy_lite; do [ -d $d/assets ] || cp -r lmdeploy_lite/assets $d/; done   # exports lack the model
CODE=${CODE:-.}
export PYTHONPATH=/tmp/site:$PWD/$CODE
cd $CODE
T="python3 -m pytest -q -p no:cacheprovider -rs -x"
F="grep -v ^USDT\|IBGDA\|^$\|warn"
timeout 240 $T tests/gpu --ignore=tests/gpu/test_multi_gpu_graphs.py 2>&1 | $F | tail -6
timeout 300 $T -s tests/gpu/test_multi_gpu_graphs.py -k "not four_gpus" tests/pytorch/test_deepep_dispatcher.py 2>&1 | $F | grep "replays\|identical\|passed\|failed\|Error" | tail -14

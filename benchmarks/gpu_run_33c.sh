#!/usr/bin/env bash
# Issue 33, after the prose/consolidation trims that followed gpu_run_33a.sh (MTP capture helper,
# ReplicatedLinear as a tp=1 ColumnParallelLinear, model_agent, strategies): the one-GPU tests on HEAD.
source .whl/gpu-env.sh
timeout ${LIMIT:-320} python3 -m pytest -q -p no:cacheprovider -rs -x tests/gpu \
  --ignore=tests/gpu/test_multi_gpu_graphs.py --ignore=tests/gpu/test_two_gpus.py 2>&1 \
  | grep -v "^USDT\|IBGDA\|^$\|Warning\|warn(" | tail -12

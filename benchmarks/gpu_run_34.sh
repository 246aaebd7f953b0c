#!/usr/bin/env bash
# Two GPUs (issue 34): rendezvous through a FileStore with loopback-pinned sockets under NCCL
# and DeepEP: what the rank processes listen on, then the two-GPU and DeepEP tests and the
# DeepEP graphs test.
source .whl/gpu-env.sh
timeout 150 python3 benchmarks/gpu_check_loopback.py 2>&1 | grep -v "^USDT\|IBGDA\|^$" | tail -4
T="python3 -m pytest -q -p no:cacheprovider -rs"
timeout 200 $T tests/gpu/test_two_gpus.py tests/pytorch/test_deepep_dispatcher.py 2>&1 | grep -v "^USDT\|IBGDA\|^$\|warn" | tail -4
timeout 200 $T -s tests/gpu/test_multi_gpu_graphs.py -k "dp2_ep2" 2>&1 | grep -v "^USDT\|IBGDA\|^$\|warn" | tail -5

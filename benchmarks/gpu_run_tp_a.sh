#!/usr/bin/env bash
# Two GPUs (issue 32), first look: where a tp=2 decode step's time goes (eager as before, CUDA
# graphs with the TP collectives captured: one-shot peer-memory all-reduce and NCCL), tp=1 beside
# it, then the two-GPU graph tests and the DeepEP tests.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
nvidia-smi topo -m | head -4
P="python3 benchmarks/profile_tp.py --preset qwen3_5_0_8b --batch-sizes 1,64 --steps 40"
timeout 100 $P --tp 1 --modes graphs --out $OUT/profile_tp1.json 2>&1 | tail -4
timeout 200 $P --tp 2 --modes eager,graphs --out $OUT/profile_tp2.json 2>&1 | tail -40
LMDEPLOY_LITE_TP_ALLREDUCE=nccl timeout 100 $P --tp 2 --modes graphs \
  --out $OUT/profile_tp2_nccl.json 2>&1 | tail -4
timeout 240 python3 -m pytest -q -x -s -p no:cacheprovider tests/gpu/test_multi_gpu_graphs.py \
  -k "(tp2_graphs and not draft_tp1 and not sequence_parallel) or dp2_ep2_deepep" 2>&1 | grep -v "^USDT" | tail -25
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_two_gpus.py \
  tests/pytorch/test_deepep_dispatcher.py 2>&1 | tail -8

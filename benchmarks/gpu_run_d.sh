#!/usr/bin/env bash
# Issue 7 on two GPUs, CUDA graphs with EP (DeepEP low-latency kernels captured).
#   bash benchmarks/gpu_run_d.sh tests   # 2-GPU tests, DeepEP, the MoE/norm kernels on a GPU
#   bash benchmarks/gpu_run_d.sh bench   # 35B-A3B shape: dp=2 ep=2 graphs vs eager, one GPU
source .whl/gpu-env.sh
export OUT=${OUT:-out}
if [ "$1" = tests ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  timeout 560 python3 -m pytest -p no:cacheprovider -rs -s -q tests/gpu/test_two_gpus.py \
    tests/pytorch/test_deepep_dispatcher.py tests/pytorch/backends/cuda/test_cuda_fused_moe.py \
    tests/pytorch/backends/cuda/test_cuda_norm.py 2>&1 | grep -v "^\s*$" | tail -25
else
  P="python3 benchmarks/bench_pipeline.py --preset qwen3_5_35b_a3b --device cuda --dtype bfloat16 --batch-sizes 1,16,64 --new-tokens 32 --repeats 2"
  timeout 170 $P --dp 2 --ep 2 --out $OUT/pipeline_35b_dp2ep2_graphs.json 2>&1 | tail -5
  timeout 170 $P --dp 2 --ep 2 --eager-mode --out $OUT/pipeline_35b_dp2ep2_eager.json 2>&1 | tail -5
  timeout 120 $P --out $OUT/pipeline_35b_1gpu.json 2>&1 | tail -5
fi

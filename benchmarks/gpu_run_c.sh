#!/usr/bin/env bash
# Final checks on two H200s: the float64/graph tests, then per-step cost of dp=2 ep=2 (all-to-all
# vs DeepEP) beside one GPU on the tiny preset (small weights: the fixed per-step cost shows).
source .whl/gpu-env.sh
export OUT=${OUT:-out}
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_smoke.py tests/gpu/test_cuda_backend.py -k "not bf16" 2>&1 | tail -1
P="python3 benchmarks/bench_pipeline.py --preset tiny --device cuda --dtype bfloat16 --batch-sizes 1,16 --new-tokens 32"
timeout 60 $P --out $OUT/tiny_1gpu.json 2>&1 | tail -3
LMDEPLOY_LITE_EP_DISPATCHER=alltoall timeout 80 $P --dp 2 --ep 2 --out $OUT/tiny_dp2ep2_alltoall.json 2>&1 | tail -3
LMDEPLOY_LITE_EP_DISPATCHER=deepep timeout 80 $P --dp 2 --ep 2 --out $OUT/tiny_dp2ep2_deepep.json 2>&1 | tail -3

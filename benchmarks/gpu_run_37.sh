#!/usr/bin/env bash
# Issue 37 on one H100: the block-scaled FP8 GEMM's GPU tests (every preset's linear shapes at
# 1-300 rows against the dequantized float32 reference; a CUDA graph replay), then
# bench_fp8_gemm.py for the 9B and 0.8B shapes (FP8 against bf16 cuBLAS, decode rows 1/16/64).
source .whl/gpu-env.sh
OUT=$(realpath -m ${OUT:-out}); mkdir -p $OUT
if [ "${PART:-kernel}" = kernel ]; then
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/pytorch/backends/cuda/test_cuda_fp8_gemm.py \
  2>&1 | grep -v "^USDT\|IBGDA\|^$" | tail -12
for preset in ${PRESETS:-qwen3_5_9b qwen3_5_0_8b}; do
  timeout 200 python3 benchmarks/bench_fp8_gemm.py --preset $preset --out $OUT/fp8_gemm_$preset.json \
    > $OUT/fp8_gemm_$preset.log 2>&1
  tail -${TAILN:-30} $OUT/fp8_gemm_$preset.log | cut -c1-120
done
fi
# PART=engine: the FP8-against-bf16 GPU test (embedded model, 32 sequences, MTP k=3, graphs)
[ "${PART:-}" = engine ] && timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_cuda.py \
  2>&1 | grep -v "^USDT\|IBGDA\|^$" | tail -6

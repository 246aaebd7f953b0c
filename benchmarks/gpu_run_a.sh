#!/usr/bin/env bash
# Issue 7 benchmarks on one GPU (see BENCHMARKS.md): correctness smoke, decode scaling beside HF,
# speculation with synthetic acceptance, the MoE shape.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_smoke.py 2>&1 | tail -2
B="python3 benchmarks/bench_decode.py --device cuda --dtype bfloat16"
timeout 200 $B --preset qwen3_5_9b --hf --hf-batch-sizes 1,16 --out $OUT/decode_9b.json 2>&1 | tail -14
timeout 80 $B --preset qwen3_5_0_8b --hf --hf-batch-sizes 1,16 --batch-sizes 1,16,64 --context-lens '' --out $OUT/decode_0_8b.json 2>&1 | tail -6
timeout 120 python3 benchmarks/bench_spec.py --preset qwen3_5_9b --device cuda --dtype bfloat16 --ks 3 --batch-sizes 1,8,32 --synthetic-acceptance 0.8,0.6,0.5 --out $OUT/spec_9b.json 2>&1 | tail -8
timeout 150 $B --preset qwen3_5_35b_a3b --batch-sizes 1,8,32,64 --context-lens 4096 --out $OUT/decode_35b_a3b.json 2>&1 | tail -7

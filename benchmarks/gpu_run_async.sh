#!/usr/bin/env bash
# Issue 8 on one GPU: the async-scheduling GPU test, then async on vs off (MTP k=3) on the
# embedded model (real acceptance) and on the 9B shape (synthetic acceptance), then AR decode of
# the 9B and 0.8B shapes beside HF transformers (issue 7's roofline goals are stated for an H100).
source .whl/gpu-env.sh
export OUT=${OUT:-out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_async_scheduling_cuda.py 2>&1 | tail -3
A="python3 benchmarks/bench_async.py --device cuda --dtype bfloat16 --batch-sizes 1,8,32,64 --ks 3"
timeout 120 $A --out $OUT/async_embedded.json 2>&1 | tail -10
timeout 200 $A --preset qwen3_5_9b --synthetic-acceptance 0.8,0.6,0.5 --out $OUT/async_9b.json 2>&1 | tail -10
B="python3 benchmarks/bench_decode.py --device cuda --dtype bfloat16"
timeout 100 $B --preset qwen3_5_9b --hf --hf-batch-sizes 1 --batch-sizes 1,16 --context-lens '' --out $OUT/decode_9b.json 2>&1 | tail -5

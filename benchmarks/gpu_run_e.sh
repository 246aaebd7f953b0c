#!/usr/bin/env bash
# One H100: the single-GPU tests after the fused add+RMSNorm, then AR decode of the 9B and 0.8B
# shapes beside HF (issue 7's roofline goals), speculation at k=3, async on/off on the 9B shape.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 300 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_cuda_smoke.py \
  tests/gpu/test_cuda_backend.py tests/gpu/test_async_scheduling_cuda.py 2>&1 | grep -E "match|passed|failed|Error" | tail -8
B="python3 benchmarks/bench_decode.py --device cuda --dtype bfloat16"
timeout 100 $B --preset qwen3_5_9b --hf --hf-batch-sizes 1 --batch-sizes 1,16 --context-lens '' --out $OUT/decode_9b.json 2>&1 | tail -5
timeout 60 $B --preset qwen3_5_0_8b --batch-sizes 1,16 --context-lens '' --out $OUT/decode_0_8b.json 2>&1 | tail -4
timeout 100 python3 benchmarks/bench_spec.py --preset qwen3_5_9b --device cuda --dtype bfloat16 --ks 3 \
  --batch-sizes 1 --synthetic-acceptance 0.8,0.6,0.5 --out $OUT/spec_9b.json 2>&1 | tail -4
timeout 120 python3 benchmarks/bench_async.py --device cuda --dtype bfloat16 --batch-sizes 1,8 --ks 3 \
  --preset qwen3_5_9b --synthetic-acceptance 0.8,0.6,0.5 --out $OUT/async_9b.json 2>&1 | tail -6

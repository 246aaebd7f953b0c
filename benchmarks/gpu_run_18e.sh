#!/usr/bin/env bash
# One H100, issue 18 closing run (1/2): the GPU tests on the final code, the 0.8B rows at batch
# 128/256 (AR and MTP k=3) and the server against pipeline() at 64 concurrent streams.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/pytorch/backends/cuda \
  tests/pytorch/engine/test_ssm_state_dtype.py tests/gpu > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|error" $OUT/gpu_tests.log | tail -3
B="python3 benchmarks/bench_pipeline.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16"
timeout 150 $B --batch-sizes 128,256 --spec-ks 0,3 --synthetic-acceptance 0.8,0.6,0.5 \
  --out $OUT/pipeline_0_8b_128_256.json > $OUT/p08.log 2>&1; tail -6 $OUT/p08.log
timeout 90 $B --batch-sizes 64 --new-tokens 256 --prompt-len 128 \
  --out $OUT/pipeline_0_8b_64_for_serve.json > $OUT/p64.log 2>&1; tail -3 $OUT/p64.log
timeout 150 python3 benchmarks/bench_serve.py --launch --preset qwen3_5_0_8b --num-prompts 64 \
  --concurrency 64 --output-len 256 --input-words 128 \
  --server-args "--device cuda --dtype bfloat16 --session-len 4096" \
  --out $OUT/serve_0_8b_64.json > $OUT/serve.log 2>&1; tail -3 $OUT/serve.log

#!/usr/bin/env bash
# One H100, issue 18: the server against pipeline() at 64 streams with 1 and 8 client processes
# (one Python client cannot parse a fast server's chunks), then the GPU tests that the earlier
# runs did not reach, verbosely.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
S="python3 benchmarks/bench_serve.py --launch --preset qwen3_5_0_8b --num-prompts 128 --concurrency 64 --output-len 256 --input-words 128"
timeout 200 $S --client-procs 8 --server-args "--device cuda --dtype bfloat16 --session-len 4096" \
  --out $OUT/serve_0_8b_64_c8.json > $OUT/serve_c8.log 2>&1; tail -2 $OUT/serve_c8.log
timeout 100 python3 benchmarks/bench_pipeline.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16 \
  --batch-sizes 64 --new-tokens 256 --prompt-len 128 --out $OUT/pipeline_64.json > $OUT/p64.log 2>&1; tail -2 $OUT/p64.log
timeout 250 python3 -m pytest -v -p no:cacheprovider --durations=15 tests/gpu > $OUT/gpu_tests_gpu.log 2>&1
echo "tests/gpu rc=$?"; grep -E "PASS|FAIL|ERROR|SKIP" $OUT/gpu_tests_gpu.log | tail -40 | cut -c1-160

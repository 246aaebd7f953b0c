#!/usr/bin/env bash
# One H100, issue 18: the server against pipeline() at 64 streams after coalescing (responses a
# consumer fell behind on go out as one) and the 1 ms GIL switch interval; the 5 ms default
# interval beside it; pipeline() at batch 64 with the same lengths.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
S="python3 benchmarks/bench_serve.py --launch --preset qwen3_5_0_8b --num-prompts 128 --concurrency 64 --output-len 256 --input-words 128"
A="--device cuda --dtype bfloat16 --session-len 4096"
timeout 150 $S --client-procs 4 --server-args "$A" --out $OUT/serve_c4.json > $OUT/serve_c4.log 2>&1; tail -1 $OUT/serve_c4.log
timeout 150 $S --client-procs 1 --server-args "$A" --out $OUT/serve_c1.json > $OUT/serve_c1.log 2>&1; tail -1 $OUT/serve_c1.log
LMDEPLOY_LITE_SWITCH_INTERVAL_S=0.005 timeout 150 $S --client-procs 4 --server-args "$A" \
  --out $OUT/serve_c4_switch5ms.json > $OUT/serve_c4_5ms.log 2>&1; tail -1 $OUT/serve_c4_5ms.log
timeout 100 python3 benchmarks/bench_pipeline.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16 \
  --batch-sizes 64 --new-tokens 256 --prompt-len 128 --out $OUT/pipeline_64.json > $OUT/p64.log 2>&1
head -3 $OUT/serve_c4.log | tail -1 | cut -c1-300; tail -2 $OUT/p64.log

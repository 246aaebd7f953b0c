#!/usr/bin/env bash
# One H100, issue 18: the server with its engine in a process of its own (the CUDA default now)
# against the engine in the server's thread, 64 streams, 0.8B preset.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
S="python3 benchmarks/bench_serve.py --launch --preset qwen3_5_0_8b --concurrency 64 --output-len 256 --input-words 128"
A="--device cuda --dtype bfloat16 --session-len 4096"
timeout 140 $S --num-prompts 128 --client-procs 4 --server-args "$A" --out $OUT/serve_proc_c4.json > $OUT/s1.log 2>&1
timeout 140 $S --num-prompts 128 --server-args "$A" --out $OUT/serve_proc_c1.json > $OUT/s2.log 2>&1
timeout 140 $S --num-prompts 64 --server-args "$A" --out $OUT/serve_proc_64_c1.json > $OUT/s3.log 2>&1
timeout 140 $S --num-prompts 64 --server-args "$A --no-engine-process" --out $OUT/serve_thread_64_c1.json > $OUT/s4.log 2>&1
for f in s1 s2 s3 s4; do grep -A1 "^concurrency" $OUT/$f.log | tail -1 | cut -c1-200; grep -m1 Error $OUT/$f.log; done

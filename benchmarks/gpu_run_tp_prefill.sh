#!/usr/bin/env bash
# Run on a two-GPU machine with .whl and .triton_autotune carried. TTFT (idle engine, prefix
# cache off) and batch-1 decode at tp=2: prefill steps eager (--max-prefill-graph-tokens 0, as
# every tp > 1 prefill ran before) against captured (GRAPH_TOKENS). PRESETS: "qwen3_5_0_8b qwen3_5_9b".
source .whl/gpu-env.sh
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p $TRITON_CACHE_DIR; cp -r .triton_autotune/. $TRITON_CACHE_DIR/
for preset in ${PRESETS:-qwen3_5_0_8b qwen3_5_9b}; do
  for graphs in 0 ${GRAPH_TOKENS:-8192}; do
    echo "== $preset tp2 prefill graphs <= $graphs"
    timeout ${LIMIT:-200} python3 benchmarks/bench_pipeline.py --preset $preset --device cuda \
      --dtype bfloat16 --tp ${TP:-2} --batch-sizes 1 --new-tokens 64 --repeats 2 \
      --no-enable-prefix-caching --ttft-lens ${LENS:-32,128,512,2048,8192} \
      --max-prefill-graph-tokens $graphs --out $OUT/${preset}_g$graphs.json \
      > $OUT/${preset}_g$graphs.log 2>&1; echo "rc=$?"
    grep -a -A8 "prompt_len" $OUT/${preset}_g$graphs.log | cut -c1-100; grep -a "^tp" $OUT/${preset}_g$graphs.log | cut -c1-100
  done
done

#!/usr/bin/env bash
# Run on a two-GPU machine with .whl, .triton_autotune and out/before (git archive <rev> lmdeploy_lite
# benchmarks | tar -x -C out/before) carried. Before/after: pipeline() decode tokens/s at tp=2 (inbox events agreed in the plan, no broadcast)
source .whl/gpu-env.sh
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p $TRITON_CACHE_DIR; cp -r .triton_autotune/. $TRITON_CACHE_DIR/
cp -r lmdeploy_lite/assets out/before/lmdeploy_lite/ 2>/dev/null
for side in before after; do
  root=$PWD; [ $side = before ] && root=$PWD/out/before
  for P in qwen3_5_0_8b:1,16,64 qwen3_5_9b:1,64; do
    preset=${P%%:*}; bs=${P##*:}
    echo "== $side $preset"
    (cd $root && PYTHONPATH=$root:/tmp/site timeout 170 python3 benchmarks/bench_pipeline.py --preset $preset --device cuda --dtype bfloat16 --tp 2 --batch-sizes $bs --new-tokens 256 --repeats 1 --out $OUT/${side}_$preset.json > $OUT/${side}_$preset.log 2>&1); grep -a "^tp2" $OUT/${side}_$preset.log | cut -c1-100
  done
done

#!/usr/bin/env bash
# The gated-delta kernel's batch-dependent tiles (f6f44b2) end to end, before ($BEFORE, default
# out/before: `git archive 1b5d396 lmdeploy_lite benchmarks | tar -x -C out/before`, carried)
# and after, in one call on one GPU with .whl and .triton_autotune carried. PART=spec: bench_spec
# AR and MTP k=3 (0.8/0.6/0.5, 32k map) at batch 1 and 8 for PRESETS; PART=ttft: bench_pipeline
# TTFT at LENS (short prompts walk the recurrent prefill kernel token by token, now in the small
# tiles at small batches); PART=start: bench_start with an empty Triton cache (the tree sums and
# a second tiling compile more: ~7.5 -> ~22 s of compiles on the 2-core CPU, AOT).
source .whl/gpu-env.sh
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p $TRITON_CACHE_DIR; cp -r .triton_autotune/. $TRITON_CACHE_DIR/
BEFORE=$(realpath ${BEFORE:-out/before}); [ -d $BEFORE/lmdeploy_lite/assets ] || cp -r lmdeploy_lite/assets $BEFORE/lmdeploy_lite/
for side in ${SIDES:-before after}; do
  root=$PWD; [ $side = before ] && root=$BEFORE
  case ${PART:-spec} in
  spec) for P in ${PRESETS:-qwen3_5_0_8b qwen3_5_9b}; do
      timeout ${LIMIT:-200} python3 $root/benchmarks/bench_spec.py --preset $P --device cuda \
        --dtype bfloat16 --batch-sizes ${BATCHES:-1,8} --ks 0,3 --token-map-size 32768 \
        --decode-steps 48 --synthetic-acceptance 0.8,0.6,0.5 --out $OUT/spec_${P}_$side.json \
        > $OUT/spec_${P}_$side.log 2>&1
      echo "== $side $P"; tail -5 $OUT/spec_${P}_$side.log | cut -c1-140; done ;;
  ttft) for P in ${PRESETS:-qwen3_5_0_8b qwen3_5_9b}; do
      timeout ${LIMIT:-200} python3 $root/benchmarks/bench_pipeline.py --preset $P --device cuda \
        --dtype bfloat16 --batch-sizes 1 --new-tokens 32 --repeats 2 --no-enable-prefix-caching \
        --ttft-lens ${LENS:-32,128,512} --out $OUT/ttft_${P}_$side.json > $OUT/ttft_${P}_$side.log 2>&1
      echo "== $side $P"; grep -a -A5 "prompt_len" $OUT/ttft_${P}_$side.log | cut -c1-120; done ;;
  start) rm -rf /tmp/triton_cold; TRITON_CACHE_DIR=/tmp/triton_cold timeout ${LIMIT:-280} python3 \
      $root/benchmarks/bench_start.py --preset ${PRESETS:-qwen3_5_0_8b} --graph-tokens 512 \
      2>&1 | tail -3 ;;
  esac
done

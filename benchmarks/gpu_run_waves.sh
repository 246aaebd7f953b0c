#!/usr/bin/env bash
# Arriving waves of prompts beside decoding streams (issues 35 and 38's ITL), on one GPU, the
# 0.8B (PRESET) on random weights, in one call: PART=tune: the prefill walk's tilings
# (tune_gdn_prefill.py); PART=waves: bench_arrivals.py --profile for WAVES ("streams arrivals
# prompt_len" triples; the engine's max batch MAXB, default the server's 256); PART=serve:
# bench_serve at CONC streams with 4 client processes, the server's engine steps traced
# (trace_hook/, summarized by step_trace.py), for each server
# argument set in BUDGETS ("name|args" items separated by ';').
source .whl/gpu-env.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
OUT=$(realpath -m ${OUT:-out}); mkdir -p $OUT
P=${PRESET:-qwen3_5_0_8b}
for part in ${PART:-tune waves serve}; do case $part in
tune)        # walks beside one-token rows, and one-token rows alone (a long row's mixed step),
  # in buckets of 65 and of 257 rows (--max-batch-size 64 and the server's 256)
  for a in "16 32 48" "16 170 48" "0 1 48" "0 1 256"; do set -- $a
    for pad in $(printf '%s\n' 1 $((257 - $1 - $3)) | sort -un); do [ $pad -ge 0 ] || continue
      timeout 120 python3 benchmarks/tune_gdn_prefill.py --rows $1 --tokens $2 --decode-rows $3 \
        --padding-rows $pad
    done
  done ;;
waves)
  echo "${WAVES:-48 16 32;48 16 170;48 1 700}" | tr ';' '\n' | while read s a l; do
    timeout 150 python3 benchmarks/bench_arrivals.py --preset $P --device cuda --dtype bfloat16 \
      --streams $s --arrivals $a --prompt-len $l --profile --max-batch-size ${MAXB:-256} \
      --out $OUT/wave_${s}_${a}_$l.json \
      2>&1 | grep -A12 "^$s streams"
  done ;;
serve)
  echo "${BUDGETS:-default|;m1024|--max-mixed-token-num 1024}" | tr ';' '\n' | while IFS='|' read name args; do
    mkdir -p $OUT/steps_$name
    PYTHONPATH=$PWD/benchmarks/trace_hook:$PYTHONPATH STEP_TRACE_DIR=$OUT/steps_$name \
      timeout 280 python3 benchmarks/bench_serve.py --launch --preset $P --server-root $PWD \
      --input-words 128 --output-len 256 --num-prompts 512 --concurrency ${CONC:-64} \
      --client-procs 4 --server-args "--device cuda --dtype bfloat16 --session-len 4096 \
      --max-batch-size 256 $args" --out $OUT/serve_$name.json > $OUT/serve_$name.log 2>&1
    echo "== $name"; grep -A2 "^concurrency" $OUT/serve_$name.log | cut -c1-200
    python3 benchmarks/step_trace.py $OUT/steps_$name --top 8
  done ;;
esac; done

#!/usr/bin/env bash
# Issue 33 (speed unchanged) and issue 35 (the server at engine speed) on one H100, side by side in
# one run: bench_pipeline 0.8B batch 1 and 64 for the code before issue 33 ($BEFORE, an export of
# b00a37a) and after ($AFTER), twice each, alternating; then bench_serve (0.8B preset, 128-token
# prompts, 256 new tokens, 64 and 256 streams, 1 and 4 client processes) before and after, with
# bench_pipeline at 256 for the ratio. PART=pipe | serve runs one half.
source .whl/gpu-env.sh
for d in _gpu/*/lmdeploy_lite; do [ -d $d/assets ] || cp -r lmdeploy_lite/assets $d/; done   # exports lack the model
OUT=$(realpath -m ${OUT:-out}); mkdir -p $OUT
P="benchmarks/bench_pipeline.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16 --new-tokens 256 --prompt-len 128 --repeats 2"
SV="benchmarks/bench_serve.py --launch --preset qwen3_5_0_8b --input-words 128 --output-len 256"
A="--device cuda --dtype bfloat16 --session-len 4096 --max-batch-size 256"
run() {  # run DIR NAME ARGS...: a python3 script of DIR's code
  local dir=$1 name=$2; shift 2
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout ${LIMIT:-150} python3 "$@" > $OUT/$name.log 2>&1)
  tail -${TAILN:-3} $OUT/$name.log | cut -c1-200
}
if [ "${PART:-all}" != serve ]; then
for i in 1 2; do
  for side in after before; do
    dir=$AFTER; [ $side = before ] && dir=$BEFORE; echo "== pipeline $side $i"
    run $dir pipe_${side}_$i $P --batch-sizes 1,64 --out $OUT/pipe_${side}_$i.json
  done
done
fi
[ "${PART:-all}" = pipe ] && exit 0
TAILN=2 LIMIT=120
for side in before after; do
  dir=$AFTER; [ $side = before ] && dir=$BEFORE
  echo "== serve $side 64 streams, 1 client"; run $dir sv64_1_$side $SV --num-prompts 128 --concurrency 64 --server-args "$A" --out $OUT/sv64_1_$side.json
  echo "== serve $side 64 streams, 4 clients"; run $dir sv64_4_$side $SV --num-prompts 128 --concurrency 64 --client-procs 4 --server-args "$A" --out $OUT/sv64_4_$side.json
done
echo "== serve after 256 streams, 4 clients"; run $AFTER sv256_4_after $SV --num-prompts 512 --concurrency 256 --client-procs 4 --server-args "$A" --out $OUT/sv256_4_after.json
echo "== serve after 256 streams, 8 clients"; run $AFTER sv256_8_after $SV --num-prompts 512 --concurrency 256 --client-procs 8 --server-args "$A" --out $OUT/sv256_8_after.json
echo "== pipeline after 256"; run $AFTER pipe256 $P --batch-sizes 256 --out $OUT/pipe256.json 2>/dev/null || true

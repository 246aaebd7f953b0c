#!/usr/bin/env bash
# A/B of a change in the server on one GPU, both sides in one call: "new" is this tree, "old" a
# copy of it with OLD_PATCH applied (a path relative to the tree, an untracked file carried
# with it, e.g. `git diff HEAD main -- lmdeploy_lite > old.patch`). The 0.8B preset (PRESET) on
# random weights, bf16,
# bench_serve at CONC streams (default 64,256) with one aiohttp client process, the server's
# engine steps traced (trace_hook/, summarized by step_trace.py); SIDES (default "new old").
#   OLD_PATCH=old.patch bash benchmarks/gpu_run_ab.sh
source .whl/gpu-env.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
OUT=$(realpath -m ${OUT:-out}); mkdir -p $OUT
P=${PRESET:-qwen3_5_0_8b}
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r lmdeploy_lite /tmp/old/ && \
  (cd /tmp/old && { patch -s -p1 < $OLDPWD/$OLD_PATCH || git apply $OLDPWD/$OLD_PATCH; }) || \
  { echo "patch failed"; exit 1; }
i=0
for side in ${SIDES:-new old}; do      # a side named twice runs twice (run-to-run spread)
  i=$((i + 1)); root=$PWD; [ $side = old ] && root=/tmp/old; run=${side}_$i
  mkdir -p $OUT/steps_$run
  PYTHONPATH=$PWD/benchmarks/trace_hook:$PYTHONPATH STEP_TRACE_DIR=$OUT/steps_$run \
    timeout 280 python3 benchmarks/bench_serve.py --launch --preset $P --server-root $root \
    --input-words 128 --output-len 256 --num-prompts 512 --concurrency ${CONC:-64,256} \
    --client-procs ${CLIENTS:-1} --client aiohttp --server-args "--device cuda --dtype bfloat16 \
    --session-len 4096 --max-batch-size 256 $SERVER_ARGS" --out $OUT/serve_$run.json \
    > $OUT/serve_$run.log 2>&1
  echo "== $run"; grep -A3 "^concurrency" $OUT/serve_$run.log | cut -c1-250
  python3 benchmarks/step_trace.py $OUT/steps_$run --top 3
done

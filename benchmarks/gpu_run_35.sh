#!/usr/bin/env bash
# Issue 35 on one H100: the OpenAI server against pipeline() on a preset shape (PRESET, default
# the 0.8B) on random weights. PART=pipe: bench_pipeline at batch 64 and 256; PART=serve: streamed
# /v1/completions at 64 and 256 streams with 1, 4 and 8 client processes, the server of $BEFORE
# (an export of the commit before this work), of the working tree ('after'), and of the working
# tree with uvloop and httptools installed ('fast', .whl/extra); REF_SIDE=fast: pipeline() on the
# same workload after that side's server (bench_serve --pipeline-reference); PART=frontend: the front-end over
# a synthetic engine (bench_frontend.py: 3 ms steps), after and fast. EXTRA: more server
# arguments (e.g. "--max-mixed-token-num 1024"), TAG: a suffix for the output files.
source .whl/gpu-env.sh
for d in _gpu/*/lmdeploy_lite; do [ -d $d/assets ] || cp -r lmdeploy_lite/assets $d/; done
OUT=$(realpath -m ${OUT:-out}); mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_fast .whl/extra/*.whl
P=${PRESET:-qwen3_5_0_8b}
SA="--device cuda --dtype bfloat16 --session-len 4096 --max-batch-size 256"
SYN=""                 # SPEC=3: MTP k=3 drafts accepted at 0.8/0.6/0.5 (this checkout's server)
SA="$SA ${EXTRA:-}"
[ -n "$SPEC" ] && SA="$SA --speculative-num-draft-tokens $SPEC" && SYN="--synthetic-acceptance 0.8,0.6,0.5"
for part in ${PART:-pipe serve}; do case $part in
pipe)
  echo "== pipeline $P"
  timeout 200 python3 benchmarks/bench_pipeline.py --preset $P --device cuda --dtype bfloat16 \
    --new-tokens 256 --prompt-len 128 --repeats 1 --batch-sizes 64,256 --out $OUT/pipe_$P.json \
    > $OUT/pipe_$P.log 2>&1
  tail -4 $OUT/pipe_$P.log | cut -c1-150 ;;
serve)
  for side in ${SIDES:-before after fast}; do
    root=$PWD; [ $side = before ] && root=$(realpath ${BEFORE:-_gpu/before})
    pp=/tmp/site; [ $side = fast ] && pp=/tmp/site_fast:/tmp/site
    echo "== serve $P $side"
    PYTHONPATH=$pp timeout 290 python3 benchmarks/bench_serve.py --launch --preset $P \
      --server-root $root --input-words 128 --output-len 256 --num-prompts ${NUM:-512} \
      --concurrency ${CONC:-64,256} --client-procs ${PROCS:-1,4,8} --server-args "$SA" \
      $([ $side = ${REF_SIDE:-none} ] && echo --pipeline-reference) $SYN \
      --out $OUT/serve_${P}_$side${SPEC:+_k$SPEC}${TAG:-}.json > $OUT/serve_${P}_$side${SPEC:+_k$SPEC}${TAG:-}.log 2>&1
    grep -A8 "^concurrency" $OUT/serve_${P}_$side${SPEC:+_k$SPEC}${TAG:-}.log | cut -c1-120
  done ;;
frontend)
  for side in after fast; do
    pp=/tmp/site; [ $side = fast ] && pp=/tmp/site_fast:/tmp/site
    echo "== frontend $side"
    PYTHONPATH=$pp:$PWD/benchmarks timeout 200 python3 benchmarks/bench_frontend.py --concurrency 64,256 \
      --client-procs 4,8 --step-ms 3 --out $OUT/frontend_$side.json > $OUT/frontend_$side.log 2>&1
    tail -6 $OUT/frontend_$side.log | cut -c1-200
  done ;;
esac; done

#!/usr/bin/env bash
# The server with 1, 2, ... front-end processes (`--api-workers`) on one GPU, in one call: the 0.8B
# preset on random weights, bf16, bench_serve at CONC streams (default 64,256) with one aiohttp
# client process, one launch per entry of WORKERS (default "1 2 4"). The first launch on a fresh
# machine compiles Triton kernels and captures graphs (~2 min): WARM=1 runs an uncounted launch
# first (64 streams, 64 prompts). A launch at 64,256 takes ~90 s once warm.
#   WARM=1 WORKERS="2 1" bash benchmarks/gpu_serve_workers.sh
# CLIENTS=4: four client processes; SPEC=3: MTP k=3 with synthetic acceptance (the warm-up too);
# EXTRA: more server flags (e.g. "--max-mixed-token-num 512": under speculation a chunk step
# alternates with decode steps, so its size bounds every stream's ITL tail); TRACE=1: the engine's
# steps traced (trace_hook/, summarized by step_trace.py; $OUT/steps_serve_w<N>).
source .whl/gpu-env.sh
export TRITON_CACHE_DIR=/tmp/triton_cache
OUT=$(realpath -m ${OUT:-out}); mkdir -p $OUT
ARGS="--device cuda --dtype bfloat16 --session-len 4096 --max-batch-size 256 $EXTRA"
SYN=""          # SPEC=3: MTP k=3 (dynamic), drafts accepted at 0.8/0.6/0.5 (serve_synthetic.py)
[ -n "$SPEC" ] && ARGS="$ARGS --speculative-num-draft-tokens $SPEC" && \
  SYN="--synthetic-acceptance 0.8,0.6,0.5"
bench() {       # workers, concurrency, prompts, name
  [ -n "$TRACE" ] && mkdir -p $OUT/steps_$4 && export STEP_TRACE_DIR=$OUT/steps_$4 \
    PYTHONPATH=$PWD/benchmarks/trace_hook:$PYTHONPATH
  timeout ${LIMIT:-240} python3 benchmarks/bench_serve.py --launch --preset qwen3_5_0_8b \
    --input-words 128 --output-len 256 --num-prompts $3 --concurrency $2 --client-procs ${CLIENTS:-1} \
    --client aiohttp $SYN --server-args "$ARGS --api-workers $1" --out $OUT/$4.json \
    > $OUT/$4.log 2>&1
}
[ -n "$WARM" ] && { bench 1 64 64 warm; echo "== warm-up rc $?"; }
for w in ${WORKERS:-1 2 4}; do
  bench $w ${CONC:-64,256} 512 serve_w$w
  echo "== api-workers $w rc $?"
  [ -n "$TRACE" ] && python3 benchmarks/step_trace.py $OUT/steps_serve_w$w --top 5
  python3 -c "
import json; d=json.load(open('$OUT/serve_w$w.json'))
for r in d['results']: print(r['concurrency'], 'tok/s %.0f ttft p50 %.1f p99 %.1f itl p50 %.2f p99 %.2f'
    % (r['output_throughput'], r['ttft_median_ms'], r['ttft_p99_ms'], r['itl_median_ms'],
       r['itl_p99_ms']), 'slow-gap events', r['slow_gaps'].get('events'), r['slow_gaps'].get('where'))" 2>&1 | tail -3
done

#!/usr/bin/env bash
# Issue 38 on one H100. PART=tests: the GPU tests of prefill graphs and the kernels they use.
# PART=steps: bench_prefill_step.py (host and wall time of prefill, prefix-hit and mixed steps,
# prefill graphs off against on) for PRESETS. PART=ttft: bench_pipeline.py TTFT rows (TTFT
# lengths, AR, best of 2) with graphs off (0) and on (8192) for PRESETS.
# PART=prefix: bench_prefix.py on the 9B. PART=itl: bench_itl.py (32 streams + an 8k prompt).
# PART=mixed: profile_mixed.py (each step of 32 streams + an 8k prompt, and of the chunks alone,
# device time by kernel family). PART=profile: profile_prefill.py (a TOKENS prompt's device time by kernel family) for PRESETS.
source .whl/gpu-env.sh
OUT=$(realpath -m ${OUT:-out}); mkdir -p $OUT
# Triton's autotune results (fla benchmarks ~100 configs per kernel and dtype, minutes on a fresh
# machine): carried in .triton_autotune (ignored), brought back as $OUT/autotune.tgz
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p $TRITON_CACHE_DIR
[ -d .triton_autotune ] && cp -r .triton_autotune/. $TRITON_CACHE_DIR/
trap '(cd $TRITON_CACHE_DIR && find . -name "*.autotune.json" | tar czf $OUT/autotune.tgz -T -)' EXIT
# SIDES="before after": benchmarks of a copy of the commit before the change (BEFORE, default
# out/before: `git archive HEAD lmdeploy_lite benchmarks | tar -x -C out/before`, carried) too
side_root() { [ "$1" = before ] && realpath ${BEFORE:-out/before} || echo $PWD; }
filter() { grep -v "^USDT\|IBGDA\|^$"; }
for part in ${PART:-tests}; do
case "$part" in
tests)
  timeout ${LIMIT:-400} python3 -m pytest -q -p no:cacheprovider -rs -x ${TESTS:-tests/gpu/test_prefill_graphs_cuda.py \
    tests/pytorch/backends/cuda/test_cuda_causal_conv1d.py tests/pytorch/backends/cuda/test_cuda_paged_attention.py} \
    2>&1 | filter | tail -${TAILN:-15} ;;
steps)
  for preset in ${PRESETS:-qwen3_5_0_8b qwen3_5_9b}; do
    timeout ${LIMIT:-300} python3 benchmarks/bench_prefill_step.py --preset $preset --out $OUT/steps_$preset.json \
      > $OUT/steps_$preset.log 2>&1
    echo "== $preset"; tail -${TAILN:-12} $OUT/steps_$preset.log | cut -c1-150
  done ;;
ttft)
  for side in ${SIDES:-after}; do root=$(side_root $side)
  for preset in ${PRESETS:-qwen3_5_0_8b qwen3_5_9b}; do
    for graph in ${GRAPHS:-0 8192}; do
      timeout ${LIMIT:-300} python3 $root/benchmarks/bench_pipeline.py --preset $preset --device cuda --dtype bfloat16 \
        --batch-sizes 1 --new-tokens 16 --repeats ${REPEATS:-2} --no-enable-prefix-caching --ttft-lens ${TTFT:-128,512,2048,8192} \
        --max-prefill-graph-tokens $graph --out $OUT/ttft_${preset}_g${graph}_$side.json > $OUT/ttft_${preset}_g${graph}_$side.log 2>&1
      echo "== $side $preset graphs<=$graph"; tail -${TAILN:-6} $OUT/ttft_${preset}_g${graph}_$side.log | cut -c1-150
    done
  done; done ;;
prefix)
  timeout ${LIMIT:-300} python3 benchmarks/bench_prefix.py --preset qwen3_5_9b --device cuda --dtype bfloat16 \
    ${PREFIX_ARGS:-} --out $OUT/prefix_9b.json > $OUT/prefix_9b.log 2>&1
  tail -${TAILN:-12} $OUT/prefix_9b.log | cut -c1-150 ;;
profile)
  for preset in ${PRESETS:-qwen3_5_0_8b}; do
    timeout ${LIMIT:-200} python3 benchmarks/profile_prefill.py --preset $preset --tokens ${TOKENS:-8192} \
      --graph-tokens ${GRAPH:-8192} --out $OUT/profile_${preset}_${TOKENS:-8192}.json > $OUT/profile_${preset}.log 2>&1
    echo "== $preset"; tail -${TAILN:-30} $OUT/profile_${preset}.log | cut -c1-150
  done ;;
mixed)
  for side in ${SIDES:-after}; do root=$(side_root $side)
  for streams in ${STREAMS:-32 0}; do
    timeout ${LIMIT:-300} python3 $root/benchmarks/profile_mixed.py --preset ${PRESET:-qwen3_5_0_8b} --streams $streams \
      --max-mixed-tokens ${M:-1024} --out $OUT/mixed_s${streams}_m${M:-1024}_$side.json > $OUT/mixed_s${streams}_$side.log 2>&1
    echo "== $side $streams streams"; grep -v "^USDT\|^STAGE\|profiler_st\|UserWarn\|_warn_once" $OUT/mixed_s${streams}_$side.log \
      | tail -${TAILN:-30} | cut -c1-200
  done; done ;;
itl)
  for side in ${SIDES:-after}; do root=$(side_root $side)
  timeout ${LIMIT:-300} python3 $root/benchmarks/bench_itl.py --preset ${PRESET:-qwen3_5_0_8b} --device cuda --dtype bfloat16 \
    ${ITL_ARGS:-} --out $OUT/itl_$side.json > $OUT/itl_$side.log 2>&1
  echo "== $side"; tail -${TAILN:-12} $OUT/itl_$side.log | cut -c1-150
  # the window step by step: wall ms, what it scheduled, stream tokens out, Engine.step's parts
  python3 -c "import json; [print('%.1f' % (e[1] - e[0]), e[2], e[3], {k: round(v, 1) if
    isinstance(v, float) else v for k, v in (e[4] if len(e) > 4 else {}).items()})
    for e in json.load(open('$OUT/itl_$side.json'))['rows'][-1]['timeline']]"
  done ;;
esac
done

#!/usr/bin/env bash
# Session of 2026-11-27 (issues 33, 36, 39) on one H100. PART=tests: every one-GPU test on the
# working tree (structured output on CUDA included); PART=pipe: bench_pipeline 0.8B batch 1 and 64
# before ($BEFORE, an export of ad64105, this session's start) and after (the working tree), twice
# each, alternating (issue 33: speed unchanged by the trims); PART=spec: the dynamic-k grid after
# the policy's new estimator (issue 39: dyn against every fixed k, 0.8B, acceptance 0.8/0.6/0.5
# and 0, 32k token map).
# PART=whole (eleventh session): whole greedy steps in one graph, bench_spec AR and k=3 (0.8/0.6/0.5,
# 32k map) before ($BEFORE, default out/before: `git archive HEAD lmdeploy_lite benchmarks | tar -x
# -C out/before`, carried) and after, in one call; PART=tests takes TESTS to pick files.
source .whl/gpu-env.sh
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p $TRITON_CACHE_DIR
[ -d .triton_autotune ] && cp -r .triton_autotune/. $TRITON_CACHE_DIR/
for d in _gpu/*/lmdeploy_lite; do [ -d $d/assets ] || cp -r lmdeploy_lite/assets $d/; done   # exports lack the model
OUT=$(realpath -m ${OUT:-out}); mkdir -p $OUT
F="grep -v ^USDT\|IBGDA\|^$\|warn"
case ${PART:-tests} in
tests)
  timeout ${LIMIT:-420} python3 -m pytest -q -p no:cacheprovider -rs ${TESTS:-tests/gpu --ignore=tests/gpu/test_multi_gpu_graphs.py \
    --ignore=tests/gpu/test_two_gpus.py} 2>&1 | $F | tail -${TAILN:-8} ;;
whole)
  for side in ${SIDES:-before after}; do root=$PWD; [ $side = before ] && root=$(realpath ${BEFORE:-out/before})
  for P in ${PRESETS:-qwen3_5_0_8b qwen3_5_9b}; do
    timeout ${LIMIT:-200} python3 $root/benchmarks/bench_spec.py --preset $P --device cuda --dtype bfloat16 \
      --batch-sizes ${BATCHES:-1,8} --ks ${KS:-3} --token-map-size 32768 --decode-steps ${STEPS:-48} \
      --synthetic-acceptance 0.8,0.6,0.5 --out $OUT/whole_${P}_$side.json > $OUT/whole_${P}_$side.log 2>&1
    echo "== $side $P"; tail -${TAILN:-5} $OUT/whole_${P}_$side.log | cut -c1-160
  done; done ;;
pipe)
  P="benchmarks/bench_pipeline.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16 --new-tokens 256 --prompt-len 128 --repeats 2 --batch-sizes 1,64"
  for i in 1 2; do for side in after before; do
    dir=.; [ $side = before ] && dir=${BEFORE:-_gpu/before}
    echo "== pipeline $side $i"
    (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 $P --out $OUT/pipe_${side}_$i.json > $OUT/pipe_${side}_$i.log 2>&1)
    tail -3 $OUT/pipe_${side}_$i.log | cut -c1-160
  done; done ;;
spec)
  P=${PRESET:-qwen3_5_0_8b}      # PRESET=qwen3_5_9b for the 9B grid
  S="benchmarks/bench_spec.py --preset $P --device cuda --dtype bfloat16 --batch-sizes 1,8,32,64,128 --ks 1,2,3 --dynamic --token-map-size 32768 --decode-steps 24"
  for acc in 0.8,0.6,0.5 0.0; do
    echo "== bench_spec $P acceptance $acc"
    timeout 280 python3 $S --synthetic-acceptance $acc --out $OUT/spec_${P}_${acc//,/_}.json > $OUT/spec_${P}_${acc//,/_}.log 2>&1
    tail -${TAILN:-8} $OUT/spec_${P}_${acc//,/_}.log | cut -c1-160
  done ;;
esac
case ${PART:-tests} in
profile)   # issue 39 item 4: where a k=3 step's time goes next to a plain one (9B and 0.8B, batch 1 and 8)
  for preset in qwen3_5_9b qwen3_5_0_8b; do for b in 1 8; do for k in 0 3; do
    echo "== profile $preset batch $b k $k"
    timeout 200 python3 benchmarks/profile_step.py --preset $preset --device cuda --dtype bfloat16 \
      --batch $b --spec $k --steps 40 > $OUT/profile_${preset}_b${b}_k$k.log 2>&1
    grep "^step:" $OUT/profile_${preset}_b${b}_k$k.log
  done; done; done ;;
esac
[ ${PART:-tests} = gemm ] && python3 benchmarks/bench_small_m_gemm.py 2>&1 | tee $OUT/small_m_gemm.log
# PART=multi (2 GPUs): the multi-GPU tests. On a fresh machine each test of
# test_multi_gpu_graphs.py takes 70-110 s (two engine starts, Triton compiles on both ranks) and its
# one-GPU reference fixture ~60 s, so they do not fit one 600 s call with the rest: MULTI=graphs
# runs that file's two-GPU tests, MULTI=rest the others (twelfth session: ~280 s and ~150 s).
if [ ${PART:-tests} = multi ]; then
  if [ ${MULTI:-graphs} = graphs ]; then
    FILES=(tests/gpu/test_multi_gpu_graphs.py -k "not four_gpus")
  else
    FILES=(tests/gpu/test_two_gpus.py tests/gpu/test_sequence_parallel_cuda.py tests/pytorch/test_deepep_dispatcher.py)
  fi
  timeout ${LIMIT:-560} python3 -m pytest -v -s -p no:cacheprovider -rs --durations=8 "${FILES[@]}" 2>&1 \
    | grep -v "^USDT\|IBGDA\|^$" | grep "replays\|identical\|passed\|failed\|Error\|SKIP\|PASS\|FAIL\|s call" | tail -${TAILN:-30}
fi
# PART=kprofile: profile_step.py with a 32k draft map (the bench's), PRESETS x BATCHES x KS, the
# device table's head and the per-step kernel count
if [ ${PART:-tests} = kprofile ]; then
  for P in ${PRESETS:-qwen3_5_0_8b}; do for b in ${BATCHES:-1}; do for k in ${KS:-0 3}; do
    echo "== profile $P batch $b k $k"
    timeout 200 python3 benchmarks/profile_step.py --preset $P --device cuda --dtype bfloat16 \
      --batch $b --spec $k --steps 40 --token-map-size 32768 > $OUT/kprof_${P}_b${b}_k$k.log 2>&1
    grep "^step:\|device per step" $OUT/kprof_${P}_b${b}_k$k.log
    grep -A${ROWS:-24} "Self CPU %" $OUT/kprof_${P}_b${b}_k$k.log | cut -c1-60,100-175 | tail -${ROWS:-24}
  done; done; done
fi
# PART=copies: eager profile_step --shapes, the copy-like aten ops of a plain and a k=3 step
if [ ${PART:-tests} = copies ]; then
  for k in ${KS:-0 3}; do
    echo "== eager ops k $k"
    timeout 200 python3 benchmarks/profile_step.py --preset ${PRESET:-qwen3_5_0_8b} --device cuda --dtype bfloat16 \
      --batch 1 --spec $k --steps 10 --token-map-size 32768 --eager --shapes --rows 400 > $OUT/copies_k$k.log 2>&1
    grep "aten::copy_\|aten::contiguous\|aten::index \|aten::cat\|aten::clone\|aten::roll\|aten::index_put\|aten::gather\|aten::where\|aten::stack" $OUT/copies_k$k.log \
      | tr -s ' ' | cut -c1-230 | head -40
  done
fi

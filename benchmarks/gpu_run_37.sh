#!/usr/bin/env bash
# Issue 37 on one H100. PART=kernel: the block-scaled FP8 GEMM's GPU tests (every preset's linear
# shapes at 1-300 rows against the dequantized float32 reference; a CUDA graph replay), then
# bench_fp8_gemm.py for the 9B and 0.8B shapes (FP8 against bf16 cuBLAS, decode rows 1/16/64).
# PART=engine: the engine-level FP8 GPU test (embedded model, 32 sequences, MTP k=3, graphs).
# PART=pipe: bench_pipeline.py, bf16 against FP8 (online quantization of random weights) for
# PRESET (default the 9B), batch BATCHES, draft counts KS (0: AR; k > 0 synthetic 0.8/0.6/0.5),
# TTFT rows at prompt lengths TTFT (e.g. 128,2048,8192). PART=moe: bench_fused_moe.py (the
# routed experts' op, bf16 and FP8, at TOKENS; SWEEP=1: a config grid beside the heuristic's).
# PART=multi: the two-GPU FP8 tests (tp2, dp2 ep2). PART=side: the 35B-A3B in FP8 on GPU 0
# against bf16 dp2 ep2 (DeepEP) on GPUs 0,1, AR and MTP k=3, 64 sequences a GPU. PART takes
# several parts, run in turn; Triton's autotune results travel as in gpu_run_38.sh.
source .whl/gpu-env.sh
OUT=$(realpath -m ${OUT:-out}); mkdir -p $OUT
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p $TRITON_CACHE_DIR
[ -d .triton_autotune ] && cp -r .triton_autotune/. $TRITON_CACHE_DIR/
trap '(cd $TRITON_CACHE_DIR && find . -name "*.autotune.json" | tar czf $OUT/autotune.tgz -T -)' EXIT
for part in ${PART:-kernel}; do
case "$part" in
kernel)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/pytorch/backends/cuda/test_cuda_fp8_gemm.py \
    2>&1 | grep -v "^USDT\|IBGDA\|^$" | tail -12
  for preset in ${PRESETS:-qwen3_5_9b qwen3_5_0_8b}; do
    timeout 200 python3 benchmarks/bench_fp8_gemm.py --preset $preset --out $OUT/fp8_gemm_$preset.json \
      > $OUT/fp8_gemm_$preset.log 2>&1
    tail -${TAILN:-30} $OUT/fp8_gemm_$preset.log | cut -c1-120
  done ;;
moe)
  timeout ${LIMIT:-400} python3 benchmarks/bench_fused_moe.py --preset ${PRESET:-qwen3_5_35b_a3b} \
    --tokens ${TOKENS:-1,16,64,256} --weights ${WEIGHTS:-bf16,fp8} ${SWEEP:+--sweep} --out $OUT/fused_moe.json > $OUT/fused_moe.log 2>&1
  tail -${TAILN:-12} $OUT/fused_moe.log | cut -c1-160 ;;
engine)
  timeout ${LIMIT:-300} python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_cuda.py \
    -k 32_sequences 2>&1 | grep "FP8\|passed\|failed\|Error" | tail -6 ;;
multi)
  timeout ${LIMIT:-400} python3 -m pytest -q -s -p no:cacheprovider -rs \
    tests/gpu/test_fp8_cuda.py -k two_gpus 2>&1 | grep "FP8\|passed\|failed\|Error\|SKIP" | tail -8 ;;
side)
  B="python3 benchmarks/bench_pipeline.py --device cuda --dtype bfloat16 --repeats 1 --loop-steps 32 \
     --preset qwen3_5_35b_a3b --new-tokens 128 --spec-ks 0,3 --no-dynamic-k \
     --synthetic-acceptance 0.8,0.6,0.5 --token-map-size 32768"
  CUDA_VISIBLE_DEVICES=0 timeout 250 $B --model-format fp8 --batch-sizes 64 --session-len 4096 \
    --out $OUT/p35_fp8_1gpu.json 2>&1 | grep -v "^USDT\|IBGDA" | tail -4
  LMDEPLOY_LITE_EP_DISPATCHER=deepep CUDA_VISIBLE_DEVICES=0,1 timeout 250 $B --dp 2 --ep 2 \
    --batch-sizes 128 --out $OUT/p35_bf16_dp2ep2.json 2>&1 | grep -v "^USDT\|IBGDA" | tail -4 ;;
pipe)
  PRESET=${PRESET:-qwen3_5_9b}
  for k in ${KS:-0}; do
    for fmt in ${FORMATS:-bf16 fp8}; do
      extra=$([ $fmt = fp8 ] && echo "--model-format fp8")
      spec=$([ $k != 0 ] && echo "--synthetic-acceptance 0.8,0.6,0.5 --no-dynamic-k")
      timeout ${LIMIT:-240} python3 benchmarks/bench_pipeline.py --preset $PRESET --device cuda \
        --dtype bfloat16 --new-tokens 256 --prompt-len 128 --repeats 1 --batch-sizes ${BATCHES:-1,16,64} \
        --spec-ks $k $spec $extra ${TTFT:+--ttft-lens $TTFT} --out $OUT/pipe_${PRESET}_${fmt}_k$k.json > $OUT/pipe_${PRESET}_${fmt}_k$k.log 2>&1
      echo "== $PRESET $fmt k=$k"; tail -${TAILN:-4} $OUT/pipe_${PRESET}_${fmt}_k$k.log | cut -c1-200
    done
  done ;;
esac
done

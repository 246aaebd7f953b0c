#!/usr/bin/env bash
# Two H200s (issue 32): the 35B-A3B shape at 64 sequences per GPU on one H200 (tp1) and on two
# (dp2 ep2, DeepEP), AR and MTP k=3 (synthetic acceptance 0.8/0.6/0.5, 32k token map); the
# scaling goal is dp2 ep2 >= 1.7x one H200. Part "sp": sequence parallelism off vs on at tp=2
# (9B shape), decode tokens/s at batch 1 / 64 and TTFT of 2k / 8k prompts, then the two-GPU
# sequence-parallel tests.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
part=${1:-scale}
if [ "$part" = scale ]; then
  B="python3 benchmarks/bench_pipeline.py --device cuda --dtype bfloat16 --repeats 1 --loop-steps 32 \
     --preset qwen3_5_35b_a3b --new-tokens 128 --spec-ks 0,3 --no-dynamic-k \
     --synthetic-acceptance 0.8,0.6,0.5 --token-map-size 32768"
  CUDA_VISIBLE_DEVICES=0 timeout 300 $B --batch-sizes 64 --out $OUT/p35_tp1_h200.json 2>&1 | grep -v "^USDT\|IBGDA" | tail -4
  timeout 260 $B --dp 2 --ep 2 --batch-sizes 128 --out $OUT/p35_dp2ep2_h200.json 2>&1 | grep -v "^USDT\|IBGDA" | tail -4
else                                   # the script of the first try, with its limits raised
  bash benchmarks/gpu_run_tp_e.sh
fi

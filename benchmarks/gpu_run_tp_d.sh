#!/usr/bin/env bash
# Four H100s (issue 32), part 3: the 35B-A3B shape at 64 sequences per GPU, dp2 ep2 (GPUs 0,1)
# then dp4 ep4, AR and MTP k=3 (synthetic acceptance 0.8/0.6/0.5, 32k token map), DeepEP.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
B="python3 benchmarks/bench_pipeline.py --device cuda --dtype bfloat16 --repeats 1 --loop-steps 32 \
   --preset qwen3_5_35b_a3b --new-tokens 128 --spec-ks 0,3 --no-dynamic-k \
   --synthetic-acceptance 0.8,0.6,0.5 --token-map-size 32768"
CUDA_VISIBLE_DEVICES=0,1 timeout 230 $B --dp 2 --ep 2 --batch-sizes 128 --out $OUT/p35_dp2ep2.json 2>&1 | grep -v "^USDT\|IBGDA" | tail -4
timeout 250 $B --dp 4 --ep 4 --batch-sizes 256 --out $OUT/p35_dp4ep4.json 2>&1 | grep -v "^USDT\|IBGDA" | tail -4

#!/usr/bin/env bash
# One H100, issue 18: the 9B shape at batch 256, AR (fp32 state) and MTP k=3 (bf16 state: at
# fp32 the 257 state slots of k=3 take 51 GB and leave no KV cache on an 80 GB card).
source .whl/gpu-env.sh
export OUT=${OUT:-out}
B="python3 benchmarks/bench_pipeline.py --preset qwen3_5_9b --device cuda --dtype bfloat16 --batch-sizes 256"
timeout 200 $B --out $OUT/pipeline_9b_256_ar.json > $OUT/p9_256_ar.log 2>&1; tail -2 $OUT/p9_256_ar.log
timeout 250 $B --spec-ks 3 --synthetic-acceptance 0.8,0.6,0.5 --ssm-state-dtype bfloat16 \
  --out $OUT/pipeline_9b_256_mtp_bf16state.json > $OUT/p9_256_mtp.log 2>&1; tail -2 $OUT/p9_256_mtp.log

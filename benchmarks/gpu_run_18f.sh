#!/usr/bin/env bash
# One H100, issue 18 closing run (2/2): the 9B shape's MTP k=3 rows and batch 256 (AR and MTP).
source .whl/gpu-env.sh
export OUT=${OUT:-out}
B="python3 benchmarks/bench_pipeline.py --preset qwen3_5_9b --device cuda --dtype bfloat16"
timeout 300 $B --batch-sizes 1,16,64,128 --spec-ks 3 --synthetic-acceptance 0.8,0.6,0.5 \
  --out $OUT/pipeline_9b_mtp.json > $OUT/p9mtp.log 2>&1; tail -7 $OUT/p9mtp.log
timeout 240 $B --batch-sizes 256 --spec-ks 0,3 --synthetic-acceptance 0.8,0.6,0.5 \
  --out $OUT/pipeline_9b_256.json > $OUT/p9_256.log 2>&1; tail -5 $OUT/p9_256.log

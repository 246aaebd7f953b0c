#!/usr/bin/env bash
# One H100, issue 18 baseline: where the decode step's device time goes at batch 64/256 (0.8B, 9B),
# and decode tokens/s through pipeline() beside the bare step loop, TTFT / prefill MFU.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
P="python3 benchmarks/profile_step.py --device cuda --dtype bfloat16 --steps 30"
for args in "qwen3_5_0_8b --batch 64" "qwen3_5_0_8b --batch 256" "qwen3_5_9b --batch 64"; do
  set -- $args
  timeout 150 $P --preset $args > $OUT/profile_$1_$3.txt 2>&1
  grep -E "^step:" $OUT/profile_$1_$3.txt; grep -A14 "Self CUDA %" $OUT/profile_$1_$3.txt | cut -c1-60,100-170
done
timeout 240 python3 benchmarks/bench_pipeline.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16 \
  --batch-sizes 1,16,64,128,256 --spec-ks 0,3 --synthetic-acceptance 0.8,0.6,0.5 \
  --ttft-lens 128,2048,8192 --out $OUT/pipeline_0_8b.json 2>&1 | tail -14

#!/usr/bin/env bash
# Two H100s (issue 32), last: sequence parallelism for prefill and mixed steps only (decode steps
# and their graphs run plain TP), 9B shape at tp=2, SP off vs on: decode tokens/s at batch 1 and
# 64 and TTFT of 2k / 8k prompts; then the two-GPU sequence-parallel tests. (Run on 2026-11-26
# with 130 s limits: the SP-off run hit it and left no figures; 200 s now, and
# `gpu_run_tp_f.sh sp` runs this script.)
source .whl/gpu-env.sh
export OUT=${OUT:-out}
B="python3 benchmarks/bench_pipeline.py --device cuda --dtype bfloat16 --repeats 2 --loop-steps 32 \
   --preset qwen3_5_9b --tp 2 --batch-sizes 1,64 --new-tokens 128 --ttft-lens 2048,8192 \
   --no-enable-prefix-caching"
timeout 200 $B --out $OUT/p9_tp2_sp_off.json 2>&1 | grep -v "^USDT" | tail -7
timeout 200 $B --sequence-parallel --out $OUT/p9_tp2_sp_on.json 2>&1 | grep -v "^USDT" | tail -7
T="python3 -m pytest -q -s -p no:cacheprovider -rs"
timeout 150 $T tests/gpu/test_multi_gpu_graphs.py -k sequence_parallel tests/gpu/test_sequence_parallel_cuda.py 2>&1 \
  | grep -v "^USDT\|IBGDA\|^$\|warn" | tail -8

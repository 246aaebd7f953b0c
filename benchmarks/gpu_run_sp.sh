#!/usr/bin/env bash
# Two GPUs (issue 24): the two-GPU tests (sequence parallelism against transformers over NCCL,
# dp2 ep2), then decode tokens/s through pipeline() at tp=2 with sequence parallelism off and on
# for the 9B and 35B-A3B shapes (random weights), batch 1 and 64.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_sequence_parallel_cuda.py \
  tests/gpu/test_two_gpus.py 2>&1 | tail -4
B="python3 benchmarks/bench_pipeline.py --device cuda --dtype bfloat16 --tp 2 --batch-sizes 1,64 \
   --new-tokens 128 --repeats 1 --loop-steps 32"
for preset in qwen3_5_9b qwen3_5_35b_a3b; do
  for sp in off on; do
    flag=$([ $sp = on ] && echo --sequence-parallel)
    timeout 150 $B --preset $preset $flag --out $OUT/sp_${preset}_$sp.json 2>&1 | tail -4
  done
done

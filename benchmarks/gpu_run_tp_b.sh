#!/usr/bin/env bash
# Four H100s (issue 32), part 1: the rest of the two-GPU graph tests on GPUs 0,1 while GPUs 2,3
# measure decode tokens/s through pipeline() (0.8B and 9B shapes, tp=1 and tp=2, AR and MTP k=3
# with synthetic acceptance and a 32k token map, sequence parallelism).
source .whl/gpu-env.sh
export OUT=${OUT:-out}
nvidia-smi topo -m | head -6
T="python3 -m pytest -q -s -p no:cacheprovider -rs"
(export CUDA_VISIBLE_DEVICES=0,1
 timeout 330 $T tests/gpu/test_multi_gpu_graphs.py -k "draft_tp1 or sequence_parallel" > $OUT/t2.log 2>&1
 timeout 150 $T tests/gpu/test_sequence_parallel_cuda.py >> $OUT/t2.log 2>&1) &
export CUDA_VISIBLE_DEVICES=2,3
B="python3 benchmarks/bench_pipeline.py --device cuda --dtype bfloat16 --repeats 1 --loop-steps 32"
S="--spec-ks 0,3 --no-dynamic-k --synthetic-acceptance 0.8,0.6,0.5 --token-map-size 32768"
timeout 80 $B --preset qwen3_5_0_8b --batch-sizes 1,16,64 --out $OUT/p08_tp1.json 2>&1 | tail -4
timeout 80 $B --preset qwen3_5_0_8b --tp 2 --batch-sizes 1,16,64 --out $OUT/p08_tp2.json 2>&1 | tail -4
timeout 110 $B --preset qwen3_5_9b --batch-sizes 1,64 --new-tokens 128 $S --out $OUT/p9_tp1.json 2>&1 | tail -5
timeout 130 $B --preset qwen3_5_9b --tp 2 --batch-sizes 1,64 --new-tokens 128 $S --out $OUT/p9_tp2.json 2>&1 | tail -5
timeout 80 $B --preset qwen3_5_9b --tp 2 --sequence-parallel --batch-sizes 1,64 --new-tokens 128 \
  --out $OUT/p9_tp2_sp.json 2>&1 | tail -3
wait
grep -v "^USDT\|IBGDA\|^$" $OUT/t2.log | tail -12

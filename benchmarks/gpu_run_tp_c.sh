#!/usr/bin/env bash
# Four H100s (issue 32), part 2: the four-GPU tests (dp4 ep4, tp2 dp2 ep4 with the MTP draft),
# the 35B-A3B shape at 64 sequences per GPU on dp2 ep2 (GPUs 0,1) and dp4 ep4, AR and MTP k=3
# (synthetic acceptance, 32k token map), and the OpenAI server at tp=1 / tp=2 (0.8B shape) and
# dp2 ep2 (the embedded MoE model) on GPUs 2,3 beside the dp2 ep2 run.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
T="python3 -m pytest -q -s -p no:cacheprovider -rs"
timeout 170 $T tests/gpu/test_multi_gpu_graphs.py -k four_gpus 2>&1 | grep -v "^USDT\|IBGDA\|^$" | tail -8
B="python3 benchmarks/bench_pipeline.py --device cuda --dtype bfloat16 --repeats 1 --loop-steps 32 \
   --preset qwen3_5_35b_a3b --new-tokens 128 --spec-ks 0,3 --no-dynamic-k \
   --synthetic-acceptance 0.8,0.6,0.5 --token-map-size 32768"
SV="python3 benchmarks/bench_serve.py --launch --concurrency 64 --num-prompts 128 --output-len 256"
(export CUDA_VISIBLE_DEVICES=2,3
 A="--device cuda --dtype bfloat16 --session-len 4096"
 timeout 70 $SV --preset qwen3_5_0_8b --input-words 128 --server-args "$A" --out $OUT/serve_tp1.json > $OUT/sv1.log 2>&1
 timeout 80 $SV --preset qwen3_5_0_8b --input-words 128 --server-args "$A --tp 2" --out $OUT/serve_tp2.json > $OUT/sv2.log 2>&1
 timeout 70 $SV --server-args "$A --dp 2 --ep 2 --speculative-num-draft-tokens 3" --out $OUT/serve_dp2ep2.json > $OUT/sv3.log 2>&1) &
CUDA_VISIBLE_DEVICES=0,1 timeout 200 $B --dp 2 --ep 2 --batch-sizes 128 --out $OUT/p35_dp2ep2.json 2>&1 | tail -4
wait
for f in sv1 sv2 sv3; do grep -A1 "^concurrency" $OUT/$f.log | tail -1 | cut -c1-180; grep -m1 Error $OUT/$f.log; done
timeout 220 $B --dp 4 --ep 4 --batch-sizes 256 --out $OUT/p35_dp4ep4.json 2>&1 | tail -4

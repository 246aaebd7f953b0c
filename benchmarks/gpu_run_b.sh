#!/usr/bin/env bash
# Issue 7 on two GPUs: dp=2 ep=2 with the MTP draft and one request (all-to-all and DeepEP),
# DeepEP against all-to-all, then the 35B-A3B shape with dp=2 ep=2 beside one GPU.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
nvidia-smi topo -m | head -3
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_two_gpus.py tests/pytorch/test_deepep_dispatcher.py -rs 2>&1 | tail -8
P="python3 benchmarks/bench_pipeline.py --preset qwen3_5_35b_a3b --device cuda --dtype bfloat16 --batch-sizes 1,16,64 --new-tokens 32"
timeout 150 $P --dp 2 --ep 2 --out $OUT/pipeline_35b_dp2ep2.json 2>&1 | tail -4
timeout 100 $P --out $OUT/pipeline_35b_1gpu.json 2>&1 | tail -4

#!/usr/bin/env bash
# One H100, issue 18: the decode tiling fixed per head size (batch-invariant bits), the mixed
# budget's trade-off (ITL p99 of 32 streams while an 8k prompt is prefilled, at 512 and 2048
# tokens) and burst throughput through pipeline() at batch 64/256.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/pytorch/backends/cuda/test_cuda_gated_delta_rule.py \
  tests/pytorch/engine/test_ssm_state_dtype.py 2>&1 | tail -2
I="python3 benchmarks/bench_itl.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16"
timeout 150 $I --max-mixed-tokens 512 --out $OUT/itl_512.json 2>&1 | tail -3
timeout 100 $I --max-mixed-tokens 2048 --mixed --out $OUT/itl_2048.json 2>&1 | tail -1
timeout 100 $I --max-mixed-tokens 1024 --mixed --out $OUT/itl_1024.json 2>&1 | tail -1
B="python3 benchmarks/bench_pipeline.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16"
timeout 150 $B --batch-sizes 1,64,256 --out $OUT/pipeline_0_8b_tiling.json 2>&1 | tail -4
timeout 100 $B --batch-sizes 256 --max-mixed-tokens 4096 --out $OUT/pipeline_0_8b_mixed4096.json 2>&1 | tail -2

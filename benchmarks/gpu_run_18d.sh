#!/usr/bin/env bash
# One H100, issue 18 final: GPU tests, then decode tokens/s through pipeline() beside the bare
# loop for the 0.8B (AR, MTP k=3 synthetic) and 9B (AR) shapes with TTFT / prefill MFU, and the
# inter-token latency of 32 streams while an 8k prompt is prefilled (mixed budget 512 vs off, 2048).
source .whl/gpu-env.sh
export OUT=${OUT:-out}
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/pytorch/backends/cuda \
  tests/pytorch/engine/test_ssm_state_dtype.py tests/gpu/test_cuda_smoke.py \
  tests/gpu/test_cuda_backend.py tests/gpu/test_async_scheduling_cuda.py 2>&1 | grep -E "match|passed|failed|Error" | tail -6
B="python3 benchmarks/bench_pipeline.py --device cuda --dtype bfloat16"
timeout 200 $B --preset qwen3_5_0_8b --batch-sizes 1,16,64,128,256 --spec-ks 0,3 \
  --synthetic-acceptance 0.8,0.6,0.5 --ttft-lens 128,2048,8192 --out $OUT/pipeline_0_8b.json 2>&1 | tail -14
timeout 170 $B --preset qwen3_5_9b --batch-sizes 1,16,64,128 --ttft-lens 128,2048,8192 \
  --out $OUT/pipeline_9b.json 2>&1 | tail -9
I="python3 benchmarks/bench_itl.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16"
timeout 100 $I --max-mixed-tokens 512 --out $OUT/itl_512.json 2>&1 | tail -3
timeout 60 $I --max-mixed-tokens 2048 --mixed --out $OUT/itl_2048.json 2>&1 | tail -1

#!/usr/bin/env bash
# One H100, issue 18: the GPU tests (kernels incl. the decode tilings and the bf16-stored state,
# engine, async), then decode tokens/s through pipeline() beside the bare loop for the 0.8B shape
# (AR and MTP k=3 at synthetic acceptance, fp32 and bf16 state), TTFT / prefill MFU, the
# inter-token latency of 32 streams while an 8k prompt is prefilled, bf16-state exactness.
source .whl/gpu-env.sh
export OUT=${OUT:-out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 420 python3 -m pytest -q -p no:cacheprovider -x tests/pytorch/backends/cuda \
  tests/pytorch/engine/test_ssm_state_dtype.py tests/gpu/test_cuda_smoke.py \
  tests/gpu/test_cuda_backend.py tests/gpu/test_async_scheduling_cuda.py 2>&1 | grep -E "match|passed|failed|Error" | tail -8
B="python3 benchmarks/bench_pipeline.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16"
timeout 240 $B --batch-sizes 1,16,64,128,256 --spec-ks 0,3 --synthetic-acceptance 0.8,0.6,0.5 \
  --ttft-lens 128,2048,8192 --out $OUT/pipeline_0_8b.json 2>&1 | tail -14
timeout 120 $B --batch-sizes 64,256 --ssm-state-dtype bfloat16 --out $OUT/pipeline_0_8b_bf16_state.json 2>&1 | tail -3
timeout 150 python3 benchmarks/bench_itl.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16 2>&1 | tail -5
timeout 100 python3 benchmarks/ssm_state_exactness.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16 2>&1 | tail -4
timeout 100 python3 benchmarks/ssm_state_exactness.py --device cuda --dtype bfloat16 --max-new-tokens 256 2>&1 | tail -4

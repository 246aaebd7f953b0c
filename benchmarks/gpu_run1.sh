#!/usr/bin/env bash
# One GPU session: kernel tests, engine GPU tests, then decode benchmarks (issue 7).
source .whl/gpu-env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import triton, torch, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/pytorch/backends/cuda 2>&1 | tail -25
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_backend.py tests/gpu/test_cuda_smoke.py -s 2>&1 | tail -25

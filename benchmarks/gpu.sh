#!/usr/bin/env bash
# The device check of a session lent a GPU (benchmarks/README.md, "On a GPU"):
# tests/reliability/test_cuda.py, then the whole-step comparison of
# benchmarks/hf_checkpointing.py on GPT-2 small (124M, batch 8 x 1024, fp32) with the
# CUDA allocator: plain PyTorch, HF checkpointing, HF checkpointing with torch SAC,
# torch.compile under activation_memory_budget=0.5, and remat (with and without
# stage options) at their peaks and at shares of plain's. About 6 minutes on an H200.
# The device image has torch and transformers but no cffi: carry its wheels (cffi,
# pycparser for Python 3.12) in .whl.
#
#   bash benchmarks/gpu.sh      # results under $OUT (the device tool's), else benchmarks/results
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
python3 setup.py build_ext --inplace -q || exit 1
out=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
timeout ${TEST_SECONDS:-150} python3 -m pytest -q -p no:cacheprovider tests/reliability/test_cuda.py 2>&1 \
    | tee "$out/test_cuda.log" | tail -30
timeout ${BENCH_SECONDS:-400} python3 benchmarks/hf_checkpointing.py --layers 12 --width 768 --vocab 50257 \
    --batch 8 --length 1024 --rounds 5 --device cuda --compile 0.5 --out "$out/hf_checkpointing-cuda.json" \
    2>&1 | tee "$out/hf.log"

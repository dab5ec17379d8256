#!/usr/bin/env bash
# Run every GPU test on the device machine (the H200 through the device tool), logs under $OUT.
# The image has torch, Triton and pytest; the repo is not installed there, so imports come from PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/bigmoe-gpu}"
mkdir -p "$out"
export PYTHONPATH="pager:app${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/gpu.txt"
python3 -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider --ignore=tests/gpu/test_tiny_fp8_vllm_gpu.py "$@" 2>&1 | tee "$out/gpu_tests.txt"

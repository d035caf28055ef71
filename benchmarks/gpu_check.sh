#!/usr/bin/env bash
# One prepared GPU check (about 5 minutes on one GPU): install, GPU tests, GPU and simulator benchmarks.
# Prints JSON lines; the CPU-only suite is what CI runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q -e ".[test]" 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
timeout 180 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -5
timeout 180 python3 benchmarks/gpu_bench.py --layers 8 --hidden 2048 --experts 8 --batch 1,16 --new-tokens 32
timeout 60 python3 benchmarks/memory.py

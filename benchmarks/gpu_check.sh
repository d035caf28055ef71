#!/usr/bin/env bash
# One prepared GPU check (at most 7 minutes on one GPU, usually less): GPU tests, then GPU benchmarks (JSON lines).
# The CPU-only suite is what CI runs. On an offline machine, wheels placed in .whl/ (a newer transformers, say) are
# installed into /tmp/site first; the project itself is used from this tree.
# Usage: bash benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"
echo "== GPU tests"
timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -30
echo "== gpu_bench (bf16 Mixtral-like, 8 layers x 8 experts, hidden 1024)"
timeout 150 python3 benchmarks/gpu_bench.py --layers 8 --hidden 1024 --experts 8 --batch 1,16 --new-tokens 32
echo "== ece_live on CUDA (built-in tiny MoE, fp32, batch 16, half of the experts cached, real link)"
timeout 90 python3 benchmarks/ece_live.py --device cuda --batch 16 --fraction 0.5
echo "== route predictor on the GPU (shipped predictor, batch 16)"
timeout 60 python3 benchmarks/predictor_overhead.py --device cuda
echo "== memory"
timeout 30 python3 benchmarks/memory.py

#!/usr/bin/env bash
# One prepared GPU check (the steps' time limits add up to 450 s, 7½ minutes, on one GPU; it usually takes far
# less): GPU tests, then GPU benchmarks (JSON lines). The CPU-only suite is what CI runs. It runs on the machine's own
# PyTorch (a CUDA build, whatever its version, not the CPU build that CI installs) and installs nothing from the
# network: on an offline machine whose transformers is older than 5.20, put a transformers wheel (and any newer
# dependency it needs) in .whl/ (git-ignored); wheels there are installed into /tmp/site first. The project itself is
# used from this tree. Exit status: 0 when every step succeeded, 1 when any failed, ran out of time or (in
# gpu_bench) gave other tokens than the unoffloaded model or counts that do not add up (each step still runs), 2 when
# PyTorch sees no CUDA device or transformers is too old (nothing is run then).
# Usage: set -o pipefail; bash benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log   (pipefail: the script's status,
# not tee's)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
rc=0
step() {  # step SECONDS COMMAND...: run it under a time limit; remember a failure, go on
  local limit=$1; shift
  timeout "$limit" "$@" || { echo "!! failed (status $?): $*"; rc=1; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" \
  || { echo "PyTorch is not installed or sees no CUDA device (a CPU build, a driver mismatch, CUDA_VISIBLE_DEVICES?):" \
       "none run"; exit 2; }
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"
python3 -c "import sys, transformers; v = tuple(int(p) for p in transformers.__version__.split('.')[:2]); \
sys.exit(v < (5, 20))" || { echo "transformers is missing or older than 5.20: put a wheel in .whl/ (see above)"
                            exit 2; }
echo "== GPU tests"
step 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rfE tests/test_gpu.py
echo "== gpu_bench (bf16 Mixtral-like, 8 layers x 8 experts, hidden 1024)"
step 120 python3 benchmarks/gpu_bench.py --layers 8 --hidden 1024 --experts 8 --batch 1,16 --new-tokens 32
echo "== ece_live on CUDA (built-in tiny MoE, fp32, batch 16, half of the experts cached, real link)"
step 90 python3 benchmarks/ece_live.py --device cuda --batch 16 --fraction 0.5
echo "== route predictor on the GPU (shipped predictor, batch 16)"
step 45 python3 benchmarks/predictor_overhead.py --device cuda
echo "== memory"
step 45 python3 benchmarks/memory.py
echo "== gpu_check: $([ $rc -eq 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED')"
exit $rc

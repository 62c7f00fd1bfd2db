#!/usr/bin/env bash
# `dflash-host doctor` on a GPU machine whose libtorch is the one a pip-installed torch brings
# (the H200 device machine: torch 2.11+cu130 in its Python, no PyPI access). Checks that doctor
# finds the driver, the CUDA runtime, cuDNN and NCCL versions and the GPUs, and that
# libtorch_cuda.so loads, then prints what libtorch_cuda.so resolves each library to.
#   device: B=target/device/dflash-host scripts/device_doctor.sh    # carry that binary
# Exits with doctor's code (0: ready; 1: a GPU is here but libtorch cannot use it).
set -euo pipefail
B=${B:-target/device/dflash-host}
TORCH=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')
SITE=$(dirname "$TORCH")
# The wheels' libraries where a pip install puts them (nvidia/<name>/lib and nvidia/cu13/lib).
LIBS=$(ls -d "$SITE"/nvidia/*/lib 2>/dev/null | tr '\n' ':')
export LIBTORCH=$TORCH
export LD_LIBRARY_PATH="$TORCH/lib:${LIBS}${LD_LIBRARY_PATH:-}"
echo "== torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.nccl.version())') (python's view)"
set +e
"$B" doctor
code=$?
set -e
echo "== ldd libtorch_cuda.so (CUDA-side libraries)"
ldd "$TORCH/lib/libtorch_cuda.so" | grep -E "cud|nccl|cublas|nvshmem|nvJit|cusparse|cufft|curand|not found" || true
exit $code

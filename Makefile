# dflash: `make run` trains the embedded default, `make test` runs the suite. Both set up what
# they need first (libtorch, model, data: scripts/setup/setup.sh, cached in $(DFLASH_CACHE)).
SHELL := /bin/bash
DFLASH_CACHE ?= $(HOME)/.cache/dflash
# The default trains in bf16 on a CPU with bf16 matrix instructions (AVX512-BF16, AMX); elsewhere
# bf16 is emulated, slower than f32, and its f32 form fits the same minutes.
CONFIG ?= $(if $(shell grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null && echo y),configs/smollm2-chitchat.toml,configs/smollm2-chitchat-f32.toml)
CARGO ?= cargo

export DFLASH_CACHE
export LIBTORCH := $(DFLASH_CACHE)/libtorch
export LD_LIBRARY_PATH := $(DFLASH_CACHE)/libtorch/lib:$(DFLASH_CACHE)/libtorch-2.11.0/nvidia/cu13/lib$(if $(LD_LIBRARY_PATH),:$(LD_LIBRARY_PATH))

.PHONY: setup build run lint test gpu-test crash-test clean-cache

setup:
	@scripts/setup/setup.sh

build: setup
	$(CARGO) build --release --workspace

run: build
	./target/release/dflash-host train --config $(CONFIG)

# Format and lint, as CI checks them before the tests. The two checkers hold the code's shape:
# imports go one way (no circle among the host's files, nor among a plugin's modules or files:
# shared types live in a module the others use and that uses none of them), and no host file
# is over 600 lines nor any function over 100 (tests aside). Clippy compiles against libtorch
# (setup); `--release` reuses the release profile's build-script outputs (torch-sys's C++ is not
# rebuilt).
lint: setup
	$(CARGO) fmt --all --check
	python3 scripts/check/module_cycles.py --files host/src
	for src in plugins/*/src; do python3 scripts/check/module_cycles.py $$src && python3 scripts/check/module_cycles.py --files $$src || exit 1; done
	python3 scripts/check/long_items.py
	$(CARGO) clippy --workspace --release --all-targets -- -D warnings

test: build
	$(CARGO) test --release --workspace --no-fail-fast

# The CUDA tests (each kernel against libtorch, the drafter's bf16 backward against fp32), which
# `make test` reports as ignored: `#[ignore = "needs a CUDA device: make gpu-test"]`, `cuda` in
# their path. Without a GPU they fail. One at a time: the kernels' on/off switch is process-wide.
gpu-test: build
	$(CARGO) test --release --workspace --no-fail-fast -- --ignored cuda --test-threads=1

# The full kill -9 test (20 kills; `make test` runs 5).
crash-test: build
	scripts/test/crash_test.sh 20

clean-cache:
	rm -rf $(DFLASH_CACHE)

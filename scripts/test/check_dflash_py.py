#!/usr/bin/env python3
"""Check an export's dflash.py: transformers' AutoModel loads the folder, and its forward gives
what dflash-host's drafter gave on the same inputs.

Usage:
  python3 scripts/test/check_dflash_py.py EXPORT_DIR REFERENCE.safetensors

EXPORT_DIR is what `dflash-host export` wrote (config.json, model.safetensors, dflash.py).
REFERENCE holds `target_hidden` [B, S, n*H], `block_embeds` [B, A*Bk, H], `anchors` [B, A]
(int64) and `hidden`, the drafter's output on them as dflash-host computed it in float32 from
the same (bf16-exact) weights; `cargo test --release --test zlab_roundtrip automodel` writes
one and runs this script (with the Python `DFLASH_PYTHON` names, else `python3`). The model runs
on the CPU in float32. Prints the largest difference; exits 1 when it is above the tolerance.

Needs torch and transformers (4.57 or 5.x) and safetensors.
"""

import argparse
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModel

# Both sides compute in float32 from the same weights; what differs is summation order (RMSNorm,
# RoPE frequencies, attention), a few ulps of values of order 1.
TOLERANCE = 1e-5


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir")
    ap.add_argument("reference")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = AutoModel.from_pretrained(args.export_dir, trust_remote_code=True, dtype=torch.float32).eval()
    name = type(model).__name__
    if name != "DFlashDraftModel":
        print(f"AutoModel gave {name}, not DFlashDraftModel")
        return 1
    ref = load_file(args.reference)
    with torch.no_grad():
        got = model(ref["target_hidden"], ref["block_embeds"], ref["anchors"])
    want = ref["hidden"]
    if got.shape != want.shape:
        print(f"output shape {tuple(got.shape)}, dflash-host's {tuple(want.shape)}")
        return 1
    diff = (got.float() - want.float()).abs().max().item()
    print(f"{name} from {args.export_dir}: max |dflash.py - dflash-host| = {diff:.3e} (tolerance {TOLERANCE:.0e})")
    return 0 if diff <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())

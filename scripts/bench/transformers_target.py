#!/usr/bin/env python3
"""transformers' own forward of a random target, beside `dflash-host bench train` on the same
config (scripts/bench/hybrid_h200.sh): the full forward (every layer and the LM head, what the
bench's "target forward (full)" row times), bf16 on CUDA, sdpa attention, random weights and ids,
no cache; untimed warm-up runs, then the median of the timed ones, the device synchronised around
each.

The Qwen3.5 hybrid's Gated DeltaNet layers take transformers' torch fallbacks unless
flash-linear-attention's kernels import (`fla` from the fla-core wheel): then its chunked Triton
kernel and fused gated norm run (the conv stays F.conv1d without causal-conv1d). The report says
which ran; `--no-fla` keeps the fallbacks where the kernels are installed.

    python3 scripts/bench/transformers_target.py --config configs/bench/qwen3.6-27b-config.json \\
        --batch 4 1 --seq 3072 --json out.json
"""

import argparse
import json
import statistics
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--config", required=True, help="an HF config.json (multimodal ones: its text_config)")
p.add_argument("--batch", type=int, nargs="+", default=[4, 1])
p.add_argument("--seq", type=int, default=3072)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--iters", type=int, default=5)
p.add_argument("--device", default="cuda", help="cuda (bf16) or cpu (f32, for trying the script)")
p.add_argument("--no-fla", action="store_true", help="transformers' torch fallbacks even where fla imports")
p.add_argument("--json")
args = p.parse_args()

if args.no_fla:
    import sys

    sys.modules["fla"] = None  # find_spec("fla") is None: transformers takes its fallbacks

import transformers  # noqa: E402

cfg = json.load(open(args.config))
text = dict(cfg.get("text_config", cfg))
model_type = text.pop("model_type")
for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
    text.pop(key, None)
if model_type.startswith("qwen3_5_moe"):
    config, cls = transformers.Qwen3_5MoeTextConfig(**text), transformers.Qwen3_5MoeForCausalLM
elif model_type.startswith("qwen3_5"):
    config, cls = transformers.Qwen3_5TextConfig(**text), transformers.Qwen3_5ForCausalLM
elif model_type == "qwen3_moe":
    config, cls = transformers.Qwen3MoeConfig(**text), transformers.Qwen3MoeForCausalLM
else:
    config, cls = transformers.AutoConfig.for_model(model_type, **text), transformers.AutoModelForCausalLM
config._attn_implementation = "sdpa"

dev = torch.device(args.device)
dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
torch.manual_seed(0)
t0 = time.perf_counter()
with torch.device(dev):
    model = (cls._from_config(config, dtype=dt) if hasattr(cls, "_from_config") else cls.from_config(config, dtype=dt)).eval()
build_s = time.perf_counter() - t0
report = {
    "transformers_version": transformers.__version__,
    "torch_version": torch.__version__,
    "model_type": model_type,
    "parameters": sum(p.numel() for p in model.parameters()),
    "build_s": build_s,
}
if model_type.startswith("qwen3_5"):
    import importlib

    # The function a Gated DeltaNet layer took at its construction (transformers' versions keep
    # it as an attribute of the layer or of the module).
    gdn = next((m for m in model.modules() if hasattr(m, "chunk_gated_delta_rule")), None)
    fn = getattr(gdn, "chunk_gated_delta_rule", None)
    if gdn is None:
        mod = importlib.import_module(type(model).__module__)
        fn = getattr(mod, "chunk_gated_delta_rule", None)
    report["gdn_kernels"] = "fla" if fn is not None and (getattr(fn, "__module__", "") or "").startswith("fla") else "torch fallback"
if hasattr(config, "experts_implementation") or hasattr(config, "_experts_implementation"):
    report["experts_implementation"] = str(getattr(config, "_experts_implementation", None))


def timed(fn):
    for _ in range(args.warmup):
        fn()
    ts = []
    for _ in range(args.iters):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


for b in args.batch:
    ids = torch.randint(0, config.vocab_size, (b, args.seq), device=dev)
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            s = timed(lambda: model(input_ids=ids, use_cache=False))
        report[f"forward_b{b}"] = {"step_s": s, "tok_per_s": b * args.seq / s}
        if dev.type == "cuda":
            report[f"forward_b{b}"]["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception as e:  # noqa: BLE001
        report[f"forward_b{b}_error"] = repr(e)[:500]
    print(json.dumps(report), flush=True)

print("HF_TARGET " + json.dumps(report), flush=True)
if args.json:
    json.dump(report, open(args.json, "w"), indent=1)

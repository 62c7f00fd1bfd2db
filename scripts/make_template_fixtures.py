#!/usr/bin/env python3
"""Chat-template fixtures for the data_chat plugin, rendered by transformers' apply_chat_template.

For every template the plugin has built in, under plugins/data_chat/templates/ (the real template
strings, sources in that folder's README; ChatML is the plugin's own), this renders a fixed set of
conversations, with and without the generation prompt and with the template kwargs the models
document (Qwen3's enable_thinking, Llama's date_string), and writes
tests/fixtures/templates/renders.json. The Rust tests render the same cases with minijinja and
must produce the very same strings.

SmolLM2's template is read out of the GGUF that `make setup` caches (tokenizer.chat_template) and
written to smollm2.jinja first, so the committed copy is the checkpoint's own.

Usage (needs transformers >= 5 and tokenizers):
    python3 scripts/make_template_fixtures.py            # writes tests/fixtures/templates/renders.json
    python3 scripts/make_template_fixtures.py --check    # re-renders, fails on any difference
"""

import argparse
import json
import os
import struct
import sys

from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "templates")
TEMPLATE_DIR = os.path.join(HERE, "..", "plugins", "data_chat", "templates")
GGUF = os.path.join(
    os.environ.get("DFLASH_CACHE", os.path.expanduser("~/.cache/dflash")),
    "SmolLM2-135M-Instruct.Q4_1.gguf",
)

# The special tokens each model's tokenizer_config.json declares (what apply_chat_template passes
# to the template as bos_token / eos_token).
TEMPLATES = {
    "chatml": {"eos_token": "<|im_end|>"},
    "smollm2": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
    "llama-3.2": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "llama-3.3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen2.5": {"eos_token": "<|im_end|>"},
    "qwen3": {"eos_token": "<|im_end|>"},
    "qwen3.5": {"eos_token": "<|im_end|>"},
}


def msg(role, content):
    return {"role": role, "content": content}


# Conversations every template renders. Contents carry what breaks naive renderers: whitespace at
# the edges (Llama trims it), newlines, quotes, Jinja-looking braces, non-ASCII text.
CONVERSATIONS = {
    "system_single": [
        msg("system", "You are terse."),
        msg("user", "What is 2+2?"),
        msg("assistant", "4"),
    ],
    "multi_turn": [
        msg("user", "Hi there"),
        msg("assistant", "Hello! How can I help?"),
        msg("user", "  Say {{ nothing }} and \"quote\" me.\n"),
        msg("assistant", "\nSure: \"{{ nothing }}\" — done. 😀  "),
    ],
    "prompt_only": [
        msg("system", "Answer in French."),
        msg("user", "Name a colour."),
        msg("assistant", "Rouge."),
        msg("user", "Another one?"),
    ],
    "unicode_multiline": [
        msg("user", "Écris deux lignes.\nMerci !"),
        msg("assistant", "Première ligne.\nDeuxième ligne."),
    ],
    # Reasoning inside the reply: Qwen3 and Qwen3.5 split it at </think>.
    "think_in_content": [
        msg("user", "Why?"),
        msg("assistant", "<think>\nBecause.\n</think>\n\nIt is so."),
    ],
}

# Per template: (conversation, add_generation_prompt, kwargs). Prompt-style cases (ending with a
# user turn) are rendered with the generation prompt, the others without.
DATE = {"date_string": "02 Dec 2026"}  # Llama-3.2 would otherwise read today's date


def cases_for(name):
    kw = DATE if name.startswith("llama") else {}
    out = []
    for conv_name, conv in CONVERSATIONS.items():
        gen = conv[-1]["role"] == "user"
        out.append((conv_name, gen, dict(kw)))
    if name in ("qwen3", "qwen3.5"):
        for conv_name in ("multi_turn", "prompt_only"):
            gen = CONVERSATIONS[conv_name][-1]["role"] == "user"
            out.append((conv_name, gen, {"enable_thinking": False}))
    return out


def gguf_chat_template(path):
    """tokenizer.chat_template from a GGUF file's metadata (GGUF v2/v3 little-endian)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SystemExit(f"{path}: not a GGUF file")
        (_version,) = struct.unpack("<I", f.read(4))
        _n_tensors, n_kv = struct.unpack("<QQ", f.read(16))

        def string():
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8")

        scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

        def value(kind):
            if kind in scalars:
                fmt = "<" + scalars[kind]
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
            if kind == 8:
                return string()
            if kind == 9:
                (inner,) = struct.unpack("<I", f.read(4))
                (n,) = struct.unpack("<Q", f.read(8))
                return [value(inner) for _ in range(n)]
            raise SystemExit(f"{path}: unknown GGUF value type {kind}")

        for _ in range(n_kv):
            key = string()
            (kind,) = struct.unpack("<I", f.read(4))
            v = value(kind)
            if key == "tokenizer.chat_template":
                return v
    raise SystemExit(f"{path}: no tokenizer.chat_template")


def tokenizer(special):
    # The template only sees the special-token strings; a one-word vocabulary is enough.
    backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--templates", default=TEMPLATE_DIR, help="the folder of the .jinja files")
    ap.add_argument("--check", action="store_true", help="compare with the committed renders.json")
    args = ap.parse_args()

    smol = os.path.join(args.templates, "smollm2.jinja")
    if not args.check:
        with open(smol, "w", encoding="utf-8", newline="") as f:
            f.write(gguf_chat_template(GGUF))

    cases = []
    for name, special in TEMPLATES.items():
        with open(os.path.join(args.templates, f"{name}.jinja"), encoding="utf-8", newline="") as f:
            template = f.read()
        tok = tokenizer(special)
        for conv_name, gen, kwargs in cases_for(name):
            rendered = tok.apply_chat_template(
                CONVERSATIONS[conv_name],
                chat_template=template,
                tokenize=False,
                add_generation_prompt=gen,
                **kwargs,
            )
            cases.append(
                {
                    "template": name,
                    "conversation": conv_name,
                    "add_generation_prompt": gen,
                    "kwargs": kwargs,
                    "rendered": rendered,
                }
            )
    doc = {
        "made_by": "scripts/make_template_fixtures.py",
        "transformers": __import__("transformers").__version__,
        "special_tokens": TEMPLATES,
        "conversations": CONVERSATIONS,
        "cases": cases,
    }
    path = os.path.join(args.out, "renders.json")
    text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
    if args.check:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        if old["cases"] != cases:
            sys.exit(f"{path}: renders differ from the committed file")
        print(f"{os.path.normpath(path)}: {len(cases)} renders unchanged")
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {os.path.normpath(path)}: {len(cases)} renders of {len(TEMPLATES)} templates")


if __name__ == "__main__":
    main()

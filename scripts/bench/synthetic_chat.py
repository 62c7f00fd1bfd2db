#!/usr/bin/env python3
"""A random target's folder and a chat dataset for training through the whole pipeline at real
shapes with random weights (`[target] random_init = true`):

  OUT/target/config.json     the model's config.json (copied)
  OUT/target/tokenizer.json  a word-level tokenizer: words w0..wN-1 and ChatML's special tokens
  OUT/chat.jsonl             records of random words, one user turn and one assistant reply

Each word is one token, so a record's length in tokens is its word count plus ChatML's markers;
the reply fills most of it, so most positions are trained on. Plain Python, no packages.

  python3 scripts/bench/synthetic_chat.py --config configs/bench/qwen3.6-27b-config.json \\
      --out /tmp/synthetic --records 128 --prompt-words 512 --reply-words 3560
"""

import argparse
import json
import os
import random

p = argparse.ArgumentParser()
p.add_argument("--config", required=True, help="the target's HF config.json")
p.add_argument("--out", required=True)
p.add_argument("--records", type=int, default=128)
p.add_argument("--prompt-words", type=int, default=512)
p.add_argument("--reply-words", type=int, default=3560)
p.add_argument("--words", type=int, default=8192, help="vocabulary (capped below the model's)")
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()

cfg = json.load(open(args.config))
vocab_size = cfg.get("text_config", cfg)["vocab_size"]
special = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
words = min(args.words, vocab_size - len(special))
assert words > 0, f"{args.config}: vocab_size {vocab_size} leaves no room for words"
vocab = {t: i for i, t in enumerate(special)}
vocab.update({f"w{i}": len(special) + i for i in range(words)})
added = [
    {"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
     "normalized": False, "special": True}
    for t in special
]
tokenizer = {
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
    "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
    "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
}

os.makedirs(os.path.join(args.out, "target"), exist_ok=True)
with open(os.path.join(args.out, "target", "config.json"), "w") as f:
    json.dump(cfg, f, indent=1)
with open(os.path.join(args.out, "target", "tokenizer.json"), "w") as f:
    json.dump(tokenizer, f)

rng = random.Random(args.seed)


def text(n):
    return " ".join(f"w{rng.randrange(words)}" for _ in range(n))


with open(os.path.join(args.out, "chat.jsonl"), "w") as f:
    for _ in range(args.records):
        msgs = [{"role": "user", "content": text(args.prompt_words)},
                {"role": "assistant", "content": text(args.reply_words)}]
        f.write(json.dumps({"messages": msgs}) + "\n")
print(f"{args.out}: {args.records} records of {args.prompt_words} + {args.reply_words} words, "
      f"{words} words in the vocabulary (model's {vocab_size})")

#!/usr/bin/env python3
"""Dataset-format fixtures for the data_chat plugin, written by HF `datasets` itself.

The same three conversations (the third a prompt without a reply) are written as
  sharegpt.parquet        Dataset.to_parquet, ShareGPT rows (conversations: from/value, system)
  messages_arrow/         Dataset.save_to_disk, OpenAI rows (messages: role/content)
  bad_role.parquet        ShareGPT rows whose row 1 has a turn from "tool" (an unknown role)
  bad_role_arrow/         the same through save_to_disk
into tests/fixtures/datasets/. The Rust tests read them next to the same conversations written
as JSONL and JSON by hand, and check every format gives the same records, and that a bad row is
named by file and row.

Usage (needs `datasets`, which brings pyarrow):
    python3 scripts/make_data_fixtures.py
"""

import os
import shutil

from datasets import Dataset

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.normpath(os.path.join(HERE, "..", "tests", "fixtures", "datasets"))

# (system prompt or "", [(role, text), ...]); roles in OpenAI names.
CONVERSATIONS = [
    ("Be brief.", [("user", "Hi!"), ("assistant", "Hello.")]),
    ("", [("user", "2+2?"), ("assistant", "4"), ("user", "And 3+3?"), ("assistant", "6, with \"quotes\" and ünïcode.")]),
    ("", [("user", "Name a colour.")]),
]
SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


def sharegpt_rows(bad=False):
    rows = []
    for i, (system, turns) in enumerate(CONVERSATIONS):
        conv = [{"from": SHAREGPT_ROLE[r], "value": t} for r, t in turns]
        if bad and i == 1:
            conv[1]["from"] = "tool"
        rows.append({"id": f"c{i}", "system": system, "conversations": conv})
    return rows


def messages_rows():
    rows = []
    for i, (system, turns) in enumerate(CONVERSATIONS):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": r, "content": t} for r, t in turns]
        rows.append({"id": f"c{i}", "messages": msgs})
    return rows


def save_dir(ds, name):
    path = os.path.join(OUT, name)
    shutil.rmtree(path, ignore_errors=True)
    ds.save_to_disk(path)


def main():
    os.makedirs(OUT, exist_ok=True)
    Dataset.from_list(sharegpt_rows()).to_parquet(os.path.join(OUT, "sharegpt.parquet"))
    save_dir(Dataset.from_list(messages_rows()), "messages_arrow")
    Dataset.from_list(sharegpt_rows(bad=True)).to_parquet(os.path.join(OUT, "bad_role.parquet"))
    save_dir(Dataset.from_list(sharegpt_rows(bad=True)), "bad_role_arrow")
    for root, _, files in sorted(os.walk(OUT)):
        for f in sorted(files):
            p = os.path.join(root, f)
            print(f"{os.path.relpath(p, OUT)}: {os.path.getsize(p)} bytes")


if __name__ == "__main__":
    main()

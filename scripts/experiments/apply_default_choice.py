#!/usr/bin/env python3
"""Write the best point of `dflash-host ab --config configs/ab-default.toml` into a run config.

    python3 scripts/experiments/apply_default_choice.py experiments/default/selection.json configs/smollm2-chitchat.toml

The best point is the highest validation score over every arm's sweep (selection.json); its
values and its arm's own changes (ab-default.toml's `[arms.<arm>]`, e.g. `drafter = { ... }`) are
written into the config's lines, its comments kept. Prints the chosen run's folder first, then
each field set.
"""
import json
import re
import sys
import tomllib
from pathlib import Path


def flat(table, prefix=""):
    for k, v in table.items():
        if isinstance(v, dict):
            yield from flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v) if isinstance(v, float) else str(v)


def set_field(lines, dotted, value):
    """`section.key` (or `section.table.key`, a key of an inline table) set in place."""
    section, key = dotted.split(".", 1)
    inner = None
    if "." in key:
        key, inner = key.split(".", 1)
    current, last_key_line = None, None
    for i, line in enumerate(lines):
        header = re.match(r"^\[([^\]]+)\]\s*$", line)
        if header:
            current = header.group(1)
            continue
        if current != section:
            continue
        m = re.match(rf"^{re.escape(key)}\s*=\s*(.*)$", line)
        if m and inner is None:
            lines[i] = f"{key} = {toml_value(value)}"
            return
        if m and inner is not None:
            new, n = re.subn(rf"(\b{re.escape(inner)}\s*=\s*)[^,}}]+", lambda g: g.group(1) + toml_value(value), line)
            if n != 1:
                sys.exit(f"{dotted}: no `{inner}` in the line `{line}`")
            lines[i] = new
            return
        if re.match(r"^[A-Za-z_]+\s*=", line):
            last_key_line = i
    if last_key_line is None or inner is not None:
        sys.exit(f"{dotted}: no [{section}] to set it in")
    lines.insert(last_key_line + 1, f"{key} = {toml_value(value)}")


def main():
    selection_path, config_path = Path(sys.argv[1]), Path(sys.argv[2])
    selection = json.loads(selection_path.read_text())
    ab = tomllib.loads(Path("configs/ab-default.toml").read_text())
    sign = 1 if selection["higher_is_better"] else -1
    best = max(
        ((a, p) for a in selection["arms"] for p in a["points"] if p["score"] is not None),
        key=lambda ap: sign * ap[1]["score"],
    )
    arm, point = best
    fields = {k: v for k, v in flat({k: v for k, v in ab["arms"][arm["arm"]].items() if k != "sweep"})}
    fields.update(point["values"])
    lines = config_path.read_text().splitlines()
    for dotted, value in fields.items():
        set_field(lines, dotted, value)
    config_path.write_text("\n".join(lines) + "\n")
    print(point["run"])
    print(f"arm {arm['arm']}, {selection['select']} {point['score']:.4f}")
    for dotted, value in fields.items():
        print(f"{dotted} = {toml_value(value)}")


if __name__ == "__main__":
    main()

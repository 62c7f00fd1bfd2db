#!/usr/bin/env python3
"""Files and functions grown past what a reader takes in at once: every `.rs` file under the
folder over 600 lines, and every function over 100 lines, counted from its `fn` line to its
closing brace. Tests aside: a `tests.rs` file's functions and the items under `#[cfg(test)]` or
`#[test]` are not measured (a `tests.rs` file still counts towards the file limit). Prints each
offender and exits 1 if there is any.

    python3 scripts/check/long_items.py host/src
"""
import re
import sys
from pathlib import Path

MAX_FILE_LINES = 600
MAX_FN_LINES = 100

FN = re.compile(r"^(\s*)(?:pub(?:\([^)]*\))?\s+)?(?:default\s+)?(?:const\s+)?(?:async\s+)?"
                r"(?:unsafe\s+)?(?:extern\s+\"[^\"]*\"\s+)?fn\s+([A-Za-z_][A-Za-z_0-9]*)")
TEST_ATTR = re.compile(r"^\s*#\[(?:cfg\(test\)|test)\]")


def body_end(lines: list, start: int, indent: str):
    """The index of the line closing the item opened at `start`, or None for a declaration
    (`fn f();`). Relies on rustfmt's layout: the closing brace sits alone at the item's indent."""
    for j in range(start, len(lines)):
        code = re.sub(r"//.*", "", lines[j]).rstrip()
        if code.endswith(";") and "{" not in "".join(lines[start : j + 1]):
            return None
        if j == start and code.endswith("}") and "{" in code:
            return j  # a one-line item
        if j > start and lines[j].rstrip() == indent + "}":
            return j
    return None


def long_functions(f: Path) -> list:
    lines = f.read_text().splitlines()
    out, i, skip_test_item = [], 0, False
    while i < len(lines):
        line = lines[i]
        if TEST_ATTR.match(line):
            skip_test_item = True
            i += 1
            continue
        if skip_test_item and line.strip() and not line.lstrip().startswith(("#[", "//")):
            # The item under a test attribute: a module, function or impl skipped whole.
            indent = re.match(r"\s*", line).group(0)
            end = body_end(lines, i, indent)
            skip_test_item = False
            i = (end if end is not None else i) + 1
            continue
        m = FN.match(line)
        if m:
            end = body_end(lines, i, m.group(1))
            if end is not None and end - i + 1 > MAX_FN_LINES:
                out.append((i + 1, m.group(2), end - i + 1))
        i += 1
    return out


def main() -> int:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "host/src")
    offenders = []
    for f in sorted(src.rglob("*.rs")):
        n = len(f.read_text().splitlines())
        if n > MAX_FILE_LINES:
            offenders.append(f"{f}: {n} lines (over {MAX_FILE_LINES})")
        if f.name == "tests.rs":
            continue
        for line, name, length in long_functions(f):
            offenders.append(f"{f}:{line}: fn {name}: {length} lines (over {MAX_FN_LINES})")
    for o in offenders:
        print(o)
    if offenders:
        print(f"{len(offenders)} items too long: split them by what their parts are")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

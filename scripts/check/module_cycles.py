#!/usr/bin/env python3
"""Import cycles among a crate's modules: which module each file names (`crate::m`, `super::m`,
`use crate::{m, ...}`) outside its tests (a `#[cfg(test)]` module, a `tests.rs`), then the strongly connected components
of that graph. Prints every module's imports and exits 1 if any cycle remains.

    python3 scripts/check/module_cycles.py plugins/target_hf/src
"""
import re
import sys
from pathlib import Path


def module_of(src: Path, f: Path) -> str:
    rel = f.relative_to(src).with_suffix("")
    parts = [p for p in rel.parts if p not in ("mod",)]
    return parts[0] if parts else "lib"


def strip_tests(text: str) -> str:
    """Drop everything from the first `#[cfg(test)]` on (test modules sit at the end of a file)."""
    i = text.find("#[cfg(test)]")
    return text if i < 0 else text[:i]


def names_in_use_tree(tree: str) -> list:
    """The first path segments of a `use crate::{...}` tree's top level."""
    out, depth, cur = [], 0, ""
    for ch in tree:
        if ch == "{":
            depth += 1
            if depth == 1:
                continue
        elif ch == "}":
            depth -= 1
            if depth == 0:
                continue
        if ch == "," and depth == 1:
            out.append(cur)
            cur = ""
            continue
        if depth >= 1:
            cur += ch
    out.append(cur)
    return [re.split(r"::|\s", s.strip())[0] for s in out if s.strip()]


def imports(src: Path, f: Path, modules: set) -> set:
    text = strip_tests(f.read_text())
    text = re.sub(r"//[^\n]*", "", text)
    own = module_of(src, f)
    found = set()
    for m in re.finditer(r"crate::\{", text):
        depth, j = 0, m.end() - 1
        while True:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        found.update(names_in_use_tree(text[m.end() - 1 : j + 1]))
    found.update(re.findall(r"crate::([a-z_0-9]+)", text))
    if f.name not in ("mod.rs", "lib.rs") and f.parent != src:
        found.update(own for _ in re.findall(r"super::", text))  # a submodule's parent: its own module
    found.update(n for n in re.findall(r"\b([a-z_0-9]+)::", text) if n in modules and f.parent == src)
    found = {n for n in found if n in modules or n in ("self",)}
    # A name that is not a module is an item of the crate root (lib.rs).
    roots = set(re.findall(r"crate::([A-Za-z_0-9]+)", text)) - modules
    if roots and own != "lib":
        found.add("lib")
    found.discard(own)
    found.discard("self")
    return found


def main() -> int:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "plugins/target_hf/src")
    # A `tests.rs` is a test module in its own file.
    files = sorted(f for f in src.rglob("*.rs") if f.name != "tests.rs")
    modules = {module_of(src, f) for f in files} - {"lib"}
    graph = {}
    for f in files:
        graph.setdefault(module_of(src, f), set()).update(imports(src, f, modules | {"lib"}))
    # Tarjan's strongly connected components.
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    for v in sorted(graph):
        print(f"{v:16} -> {', '.join(sorted(graph[v])) or '-'}")
    cycles = [sorted(c) for c in sccs if len(c) > 1]
    for c in cycles:
        print("cycle:", " <-> ".join(c))
    print(f"{len(graph)} modules, {len(cycles)} import cycles")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())

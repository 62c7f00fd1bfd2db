#!/usr/bin/env python3
"""Import cycles in a crate: the paths each file names outside its tests (`use` trees,
`crate::a::b::Item`, `super::x`, `self::x`, a child module's or an imported module's name), each
resolved to the deepest file that exists, then the strongly connected components of that graph.
A `mod.rs` that re-exports a child imports it; a parent only declaring `mod child;` does not.

    python3 scripts/check/module_cycles.py plugins/target_hf/src          # top-level modules
    python3 scripts/check/module_cycles.py --files host/src               # every .rs file

Prints each cycle (and with -v every node's imports); exits 1 if any cycle remains.
"""
import re
import sys
from pathlib import Path

# Comments, raw and plain strings, char literals: nothing in them is a path. Nor is a visibility's
# `pub(in crate::a)`: it names an ancestor the item is seen from, not a module the file uses.
NOT_CODE = re.compile(
    r'//[^\n]*|/\*.*?\*/|\bb?r(#*)".*?"\1|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\\\'])\'|\bpub\s*\(\s*in\s[^)]*\)', re.S
)
PATH = re.compile(r"\b[A-Za-z_]\w*(?:\s*::\s*[A-Za-z_]\w*)+")


def module_path(src: Path, f: Path) -> tuple:
    """host/src/train/start.rs -> (train, start); a mod.rs is its folder's module, lib.rs the root."""
    parts = f.relative_to(src).with_suffix("").parts
    return parts[:-1] if parts[-1] in ("mod", "lib") else parts


def code_of(text: str) -> str:
    """The code without comments, literals and `#[cfg(test)]` items (up to their `;` or `{...}`)."""
    code = NOT_CODE.sub(" ", text)
    while (i := code.find("#[cfg(test)]")) >= 0:
        k = min(x for x in (code.find(";", i), code.find("{", i), len(code) - 1) if x >= 0)
        k = matching_brace(code, k) if code[k] == "{" else k
        code = code[:i] + code[k + 1 :]
    return code


def split_top(s: str) -> list:
    """`a, b::{c, d}` -> [`a`, `b::{c, d}`]: the commas outside braces."""
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [p for p in out + [cur] if p.strip()]


def expand(tree: str, prefix=()) -> list:
    """A `use` tree as (path, local name) pairs: `a::{self, b as c}` -> ((a,), a), ((a, b), c)."""
    head, brace, rest = tree.partition("{")
    path, _, alias = head.partition(" as ")
    segs = prefix + tuple(s for s in re.split(r"\s*::\s*", path.strip()) if s)
    if brace:
        return [p for part in split_top(rest[: rest.rindex("}")]) for p in expand(part, segs)]
    if segs and segs[-1] == "self":
        segs = segs[:-1]
    return [(segs, alias.strip() or (segs[-1] if segs else ""))]


def resolve(segs, here, aliases, modules):
    """The deepest module a path reaches, or None for an extern crate's or a local item's."""
    first, rest = segs[0], list(segs[1:])
    if first == "crate":
        base = ()
    elif first in ("self", "super"):
        base = here if first == "self" else here[:-1]
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    elif first in aliases:
        base = aliases[first]
    elif here + (first,) in modules:
        base = here + (first,)
    else:
        return None
    path = base + tuple(rest)
    return next(path[:k] for k in range(len(path), -1, -1) if path[:k] in modules)


def matching_brace(code: str, i: int) -> int:
    depth = 0
    for k in range(i, len(code)):
        depth += {"{": 1, "}": -1}.get(code[k], 0)
        if depth == 0:
            return k
    return len(code) - 1


def imports(here: tuple, code: str, modules: dict) -> set:
    """The modules a file's code reaches (an inline `mod m { .. }` read as the module here::m)."""
    found = set()
    while m := re.search(r"\bmod\s+(\w+)\s*\{", code):
        end = matching_brace(code, m.end() - 1)
        found |= imports(here + (m.group(1),), code[m.end() : end], modules)
        code = code[: m.start()] + code[end + 1 :]
    uses = [p for m in re.finditer(r"\buse\s+([^;]+);", code) for p in expand(m.group(1))]
    aliases = {}
    for segs, local in uses:  # `use crate::config;` makes `config::X` a path into config
        if segs and resolve(segs, here, aliases, modules) == segs:
            aliases[local] = segs
    rest = re.sub(r"\buse\s+[^;]+;", " ", code)
    paths = [s for s, _ in uses if s] + [tuple(re.split(r"\s*::\s*", p)) for p in PATH.findall(rest)]
    for segs in paths:
        target = resolve(segs, here, aliases, modules)
        if target is not None and target != here:
            found.add(target)
    return found


def cycles_of(graph: dict) -> list:
    """Tarjan's strongly connected components of more than one node."""
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [c for c in sccs if len(c) > 1]


def one_circle(graph: dict, comp: list) -> list:
    """A shortest way from the component's first node back to it, for the message."""
    start, parent, todo = comp[0], {comp[0]: None}, [comp[0]]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                way = [v]
                while parent[way[-1]] is not None:
                    way.append(parent[way[-1]])
                return way[::-1] + [start]
            if w in comp and w not in parent:
                parent[w] = v
                todo.append(w)
    return comp


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    by_file, verbose = "--files" in sys.argv, "-v" in sys.argv
    src = Path(args[0] if args else "plugins/target_hf/src")
    # A `tests.rs` is a test module in its own file; main.rs is a binary's root, imported by none.
    files = sorted(f for f in src.rglob("*.rs") if f.name not in ("tests.rs", "main.rs"))
    modules = {module_path(src, f): f for f in files}

    def node(m: tuple) -> str:
        if by_file:
            return str(modules[m].relative_to(src))
        return m[0] if m else "lib"

    graph = {}
    for m, f in modules.items():
        edges = {node(t) for t in imports(m, code_of(f.read_text()), modules)} - {node(m)}
        graph.setdefault(node(m), set()).update(edges)
    if verbose:
        for v in sorted(graph):
            print(f"{v:24} -> {', '.join(sorted(graph[v])) or '-'}")
    cycles = cycles_of(graph)
    for c in cycles:
        print(f"cycle in {src}: {' -> '.join(one_circle(graph, c))}" + (f" (all: {', '.join(c)})" if len(c) > 2 else ""))
    print(f"{src}: {len(graph)} {'files' if by_file else 'modules'}, {len(cycles)} import cycles")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())

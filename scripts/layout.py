#!/usr/bin/env python3
"""Print the layout of ``src/``: each module's line count, the package import graph, every
import cycle (lazy imports inside functions included) and every import against the layers.

    python scripts/layout.py            # the report; exits 1 on a cycle, a module over 600 lines
                                        # or an import of a higher (or same-level) package
    python scripts/layout.py --graph    # also every module's imports of other ciuic modules

The layers, lowest first (each package's docstring says the same): a package imports only
packages of lower levels. Level 0 is the foundation modules, which import only each other.

It reads the source with ``ast`` and imports nothing, so it runs without the project's
dependencies installed.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"
LIMIT = 600
SKIP = ("migrations",)  # Alembic's generated scripts are not part of the design
FOUNDATION = ("ciuic.errors", "ciuic.knobs", "ciuic.faults", "ciuic.threads", "ciuic.version",
              "ciuic.words")
LEVELS: dict[str, int] = {
    **dict.fromkeys(FOUNDATION, 0),
    "ciuic.format": 1,
    "ciuic.store": 2, "ciuic.catalog": 2, "ciuic.engine": 2, "ciuic.state": 2,
    "ciuic.supervisor": 2,
    "ciuic.chain": 3,
    "ciuic.restore": 4,
    "ciuic.distributed": 5,
    "ciuic.manager": 6, "ciuic.server": 6, "ciuic_client": 6,
    "ciuic.demo": 7, "ciuic.integrations": 7,
    "ciuic.cli": 8,
    # the import paths users know: thin re-exports over everything
    "ciuic": 9, "ciuic.snapshot": 9, "ciuic.data": 9, "ciuic.holder": 9, "ciuic.__main__": 9,
}


def modules(root: Path = ROOT) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        if any(part in SKIP for part in rel.parts):
            continue
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is, or lies in (``a.b.c`` -> ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports the submodule when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        for name in names:
            target = _resolve(name, known)
            if target is not None and target != mod:
                out.add(target)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
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
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_of(mod: str, known: dict[str, Path]) -> str:
    """A module's package (a package's own ``__init__`` belongs to itself; a module directly
    in the top-level package, such as ``ciuic.errors``, is a unit of its own)."""
    if known[mod].name == "__init__.py":
        return mod
    parent = mod.rpartition(".")[0]
    return parent if "." in parent else mod


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", action="store_true", help="print each module's imports")
    parser.add_argument("--root", type=Path, default=ROOT, help="the source folder (src/)")
    args = parser.parse_args()
    known = modules(args.root)
    graph = {m: imports(m, p, known) for m, p in known.items()}
    print(f"{'lines':>6}  module")
    over = []
    for mod, path in known.items():
        n = sum(1 for _ in path.open(encoding="utf-8"))
        flag = f"  <-- over {LIMIT}" if n > LIMIT else ""
        if flag:
            over.append(mod)
        print(f"{n:>6}  {mod}{flag}")
    if args.graph:
        print("\nimports (of ciuic modules):")
        for mod in known:
            print(f"  {mod} -> {', '.join(sorted(graph[mod])) or '-'}")
    pkgs: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        src = package_of(mod, known)
        for t in targets:
            dst = package_of(t, known)
            if dst != src and not dst.startswith(src + "."):
                pkgs.setdefault(src, set()).add(dst)
    print("\npackage graph:")
    for src in sorted(pkgs):
        print(f"  {src} -> {', '.join(sorted(pkgs[src]))}")
    found = cycles(graph)
    print(f"\nmodule import cycles: {len(found)}")
    for comp in found:
        print("  " + " <-> ".join(comp))
    against = []
    for src in sorted(pkgs):
        for dst in sorted(pkgs[src]):
            if src not in LEVELS or dst not in LEVELS:
                against.append(f"{src} -> {dst} (a package without a level: add it to LEVELS)")
            elif LEVELS[dst] >= LEVELS[src] and not (LEVELS[src] == 0 == LEVELS[dst]):
                against.append(f"{src} (level {LEVELS[src]}) -> {dst} (level {LEVELS[dst]})")
    print(f"imports against the layers: {len(against)}")
    for line in against:
        print("  " + line)
    if over:
        print(f"modules over {LIMIT} lines: {', '.join(over)}")
    return 1 if found or over or against else 0


if __name__ == "__main__":
    sys.exit(main())

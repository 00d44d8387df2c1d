"""Commands that look inside snapshots: ``diff`` and ``inspect``."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import click

from ciuic.cli.app import (
    app,
    argument,
    console,
    current_repo,
    print_table,
    resolve,
    say,
    size_text,
    tensor_table,
)

if TYPE_CHECKING:  # imported where a table is drawn: not by the help
    from rich.table import Table


@app.command("diff")
@argument("a", help="The older snapshot: ID, JOB@STEP, ...")
@argument("b", help="The newer snapshot (any job)")
@click.option("--json", "as_json", is_flag=True, help="Print JSON")
@click.option("--all", "show_all", is_flag=True, help="List unchanged tensors too")
def diff_cmd(a: str, b: str, as_json: bool, show_all: bool) -> None:
    """Compare two snapshots: each tensor changed (how much), added or removed; the values
    and metrics that changed. Tensors stored as the same chunks are not read."""
    from ciuic.restore.diff import diff  # imports torch

    repo = current_repo()
    (repo_a, info_a), (repo_b, info_b) = resolve(a, repo), resolve(b, repo)
    result = diff(repo_a, info_a, repo_b, info_b)
    if as_json:
        console.print_json(json.dumps(result.to_json(), default=str, allow_nan=False))
        return
    counts: dict[str, int] = {}
    for t in result.tensors:
        counts[t.status] = counts.get(t.status, 0) + 1
    read = sum(1 for t in result.tensors if t.read)
    say(f"[bold]{info_a.ref}[/bold] ({info_a.short_id}) -> [bold]{info_b.ref}[/bold] "
        f"({info_b.short_id})", 4)
    say("tensors: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in (
        "changed", "unchanged", "added", "removed")) + f"; {read} read "
        f"({size_text(result.bytes_read)}), the others compared by their chunks' digests", 9)
    shown = [t for t in result.tensors if show_all or t.status != "unchanged"]
    if shown:
        table = tensor_table("tensor", "status", "max |a-b|", "norm change", "NaN/Inf",
                             "changed", "dtype, shape")
        for t in shown:
            table.add_row(t.path, _status(t), _num(t.max_abs_diff), _change(t.rel_norm_change),
                          _nonfinite(t.nonfinite_a, t.nonfinite_b),
                          "-" if t.changed_elements is None else str(t.changed_elements),
                          t.note or f"{t.dtype} {tuple(t.shape)}")
        print_table(table)
    for title, rows in (("values", result.values), ("metrics", result.metrics)):
        if rows:
            console.print(f"[bold]{title} changed[/bold] ({len(rows)})")
            for row in rows[:200]:
                say(f"  {row.path}: {_plain(row.a)} -> {_plain(row.b)}", 4, markup=False)
            if len(rows) > 200:
                console.print(f"  ... {len(rows) - 200} more (--json lists them all)")


@app.command("inspect")
@argument("snap", help="ID, ID prefix, JOB@STEP, JOB@latest or JOB@healthy")
@argument("tensor", required=False, help="One tensor's path (as listed): its histogram")
@click.option("--json", "as_json", is_flag=True, help="Print JSON")
@click.option("--bins", type=click.IntRange(2, 200), default=20, metavar="N",
              help="Histogram bins")
@click.option("--compute/--no-compute", default=True,
              help="For a snapshot older than recorded statistics, compute them by reading its "
                   "tensors")
def inspect_cmd(snap: str, tensor: str | None, as_json: bool, bins: int, compute: bool) -> None:
    """Show a snapshot's health and each tensor's statistics (NaN, Inf, min, max, mean, L2
    norm), as recorded when it was written; with TENSOR, that tensor's histogram."""
    from ciuic.restore import inspect  # imports torch

    repo, info = resolve(snap)
    if tensor is not None:
        h = inspect.histogram(repo, info, tensor, bins)
        if as_json:
            console.print_json(json.dumps({"tensor": h.row.to_json(), "edges": h.edges,
                                           "counts": h.counts}))
            return
        _print_health(info)
        print_table(_stats_table([h.row]))
        for line in histogram_lines(h.edges, h.counts):
            console.print(line, highlight=False)
        return
    rows = inspect.tensors(repo, info, compute=compute)
    if as_json:
        console.print_json(json.dumps({"id": info.id, "ref": info.ref,
                                       "health": info.to_json()["health"],
                                       "tensors": [r.to_json() for r in rows]}))
        return
    _print_health(info)
    print_table(_stats_table(rows))
    if any(r.computed for r in rows):
        say("(statistics marked * were computed now: this snapshot was written before ciuic "
            "recorded them)", 1)


def _print_health(info: Any) -> None:
    console.print(f"[bold]{info.ref}[/bold] ({info.short_id}): {health_text(info)}")
    for reason in info.health.reasons if info.health is not None else ():
        say(f"  - {reason}", 4, markup=False)


def health_text(info: Any) -> str:
    """A snapshot's health as ``ciuic log`` and ``inspect`` show it."""
    if info.healthy is None:
        return "[dim]health not recorded[/dim]"
    return "[green]healthy[/green]" if info.healthy else "[red]unhealthy[/red]"


def _stats_table(rows: list[Any]) -> Table:
    table = tensor_table("tensor", "dtype, shape", "NaN", "Inf", "min", "max", "mean", "norm")
    for r in rows:
        s = r.stats
        mark = "*" if r.computed else ""
        if s is None:
            table.add_row(r.path, f"{r.dtype} {tuple(r.shape)}", *(["-"] * 6))
            continue
        bad = "[red]{}[/red]".format
        shown = s.summary()  # NaN, or not known, where the tensor holds NaN or Inf
        table.add_row(r.path, f"{r.dtype} {tuple(r.shape)}",
                      bad(s.nan) if s.nan else "0", bad(s.inf) if s.inf else "0",
                      _num(shown["min"]), _num(shown["max"]), _num(shown["mean"]),
                      _num(shown["norm"]) + mark)
    return table


def histogram_lines(edges: list[float], counts: list[int], width: int = 40) -> list[str]:
    """A histogram as text lines: each bin's range, a bar and its count."""
    if not counts:
        return ["(no finite values)"]
    top = max(counts) or 1
    lines = []
    for i, c in enumerate(counts):
        bar = "█" * round(width * c / top) if c else ""
        lines.append(f"{edges[i]:>11.4g} .. {edges[i + 1]:<11.4g} {bar:<{width}} {c}")
    return lines


def _status(t: Any) -> str:
    if t.status == "changed" and t.nonfinite_b and not t.nonfinite_a:
        return "[red]changed: NaN/Inf appeared[/red]"
    styles = {"changed": "[yellow]changed[/yellow]", "added": "[green]added[/green]",
              "removed": "[red]removed[/red]"}
    return styles.get(str(t.status), str(t.status))


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _change(x: float | None) -> str:
    """A relative change as a percentage ("nan", "inf": a norm that is not finite)."""
    return "-" if x is None else f"{x:+.2%}" if math.isfinite(x) else f"{x:.4g}"


def _nonfinite(a: int | None, b: int | None) -> str:
    if a is None or b is None:
        return "-"
    return "0" if not a and not b else f"{a} -> {b}"


def _plain(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."

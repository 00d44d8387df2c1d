"""Commands that look inside snapshots: ``diff``."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from ciuic.cli.app import app, console, current_repo, size_text


@app.command("diff")
def diff_cmd(a: Annotated[str, typer.Argument(help="The older snapshot: ID, JOB@STEP, ...")],
             b: Annotated[str, typer.Argument(help="The newer snapshot (any job)")],
             as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
             show_all: Annotated[bool, typer.Option(
                 "--all", help="List unchanged tensors too")] = False) -> None:
    """Compare two snapshots: each tensor changed (how much), added or removed; the values
    and metrics that changed. Tensors stored as the same chunks are not read."""
    from ciuic.restore.diff import diff  # imports torch

    repo = current_repo()
    info_a, info_b = repo.resolve(a), repo.resolve(b)
    result = diff(repo, info_a, repo, info_b)
    if as_json:
        console.print_json(json.dumps(result.to_json(), default=str))
        return
    counts: dict[str, int] = {}
    for t in result.tensors:
        counts[t.status] = counts.get(t.status, 0) + 1
    read = sum(1 for t in result.tensors if t.read)
    console.print(f"[bold]{info_a.ref}[/bold] ({info_a.short_id}) -> [bold]{info_b.ref}"
                  f"[/bold] ({info_b.short_id})")
    console.print("tensors: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in (
        "changed", "unchanged", "added", "removed")) + f"; {read} read "
        f"({size_text(result.bytes_read)}), the others compared by their chunks' digests")
    shown = [t for t in result.tensors if show_all or t.status != "unchanged"]
    if shown:
        table = Table("tensor", "status", "max |a-b|", "norm change", "NaN/Inf", "changed",
                      "dtype, shape")
        for t in shown:
            table.add_row(t.path, _status(t), _num(t.max_abs_diff),
                          "-" if t.rel_norm_change is None else f"{t.rel_norm_change:+.2%}",
                          _nonfinite(t.nonfinite_a, t.nonfinite_b),
                          "-" if t.changed_elements is None else str(t.changed_elements),
                          t.note or f"{t.dtype} {tuple(t.shape)}")
        console.print(table)
    for title, rows in (("values", result.values), ("metrics", result.metrics)):
        if rows:
            console.print(f"[bold]{title} changed[/bold] ({len(rows)})")
            for row in rows[:200]:
                console.print(f"  {row.path}: {_plain(row.a)} -> {_plain(row.b)}",
                              highlight=False)
            if len(rows) > 200:
                console.print(f"  ... {len(rows) - 200} more (--json lists them all)")


def _status(t: Any) -> str:
    if t.status == "changed" and t.nonfinite_b and not t.nonfinite_a:
        return "[red]changed: NaN/Inf appeared[/red]"
    styles = {"changed": "[yellow]changed[/yellow]", "added": "[green]added[/green]",
              "removed": "[red]removed[/red]"}
    return styles.get(str(t.status), str(t.status))


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _nonfinite(a: int | None, b: int | None) -> str:
    if a is None or b is None:
        return "-"
    return "0" if not a and not b else f"{a} -> {b}"


def _plain(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."

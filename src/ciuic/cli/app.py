"""The Typer application every command registers on, and what the commands share: the store
option, opening an existing store, sizes and times as people read them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from ciuic.chain.repo import Repository, default_location
from ciuic.errors import CiuicError

app = typer.Typer(
    name="ciuic", no_args_is_help=True, add_completion=False,
    help="ciuic: the snapshot chain for PyTorch training.",
    context_settings={"help_option_names": ["-h", "--help"]},
)



console = Console()



err = Console(stderr=True)



options: dict[str, Any] = {}



StoreOpt = Annotated[str | None, typer.Option(
    "--store", "-s", help="Store directory or URL (default: $CIUIC_HOME, else ./.ciuic).")]



@app.callback()
def _main(store: StoreOpt = None) -> None:
    options["store"] = store



def current_repo() -> Repository:
    return open_existing(options.get("store") or default_location())



def open_existing(location: str) -> Repository:
    if "://" not in str(location):
        path = Path(location).expanduser()
        if not path.exists():
            raise CiuicError(f"no ciuic store at {path.resolve()}: run a training job or "
                             "`ciuic demo` first, or point --store / CIUIC_HOME at an existing "
                             "one")
        if not (path / "objects").is_dir():  # would make a new, empty store there
            parent = path.resolve().parent
            hint = (f"; the store is {parent}, its objects are in {path.name}/"
                    if path.name == "objects" and (parent / "catalog.db").exists() else
                    "; point --store / CIUIC_HOME at the folder that holds objects/ and "
                    "catalog.db")
            raise CiuicError(f"{path.resolve()} is not a ciuic store (no objects/ folder)"
                             f"{hint}")
    return Repository.open(location)



def size_text(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)



def time_text(created: str | None) -> str:
    return created[:19].replace("T", " ") if created else "-"



def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err, transient=True)

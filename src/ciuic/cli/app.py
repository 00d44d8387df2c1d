"""The Typer application every command registers on, and what the commands share: the store
option, opening an existing store, sizes and times as people read them."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from ciuic.errors import CiuicError

if TYPE_CHECKING:
    from ciuic.chain.repo import Repository


def _plain_help() -> None:
    """Help that shows what to type, as command lines do (``restore SNAP --to FILE``), not the
    Python types Typer labels parameters with (``{snap}``, ``<bool>``, ``<str>``). Only the
    help's presentation hooks are replaced, each only where this Typer has it."""
    from typer import core

    def usage_name(self: Any) -> str:
        name = str(self.metavar or self.name).upper()
        name = name if self.required else f"[{name}]"
        return name + ("..." if self.nargs != 1 else "")

    def panel_name(self: Any) -> str:
        return str(self.metavar or self.name).upper() + ("..." if self.nargs != 1 else "")

    def option_type(self: Any, ctx: Any) -> str | None:
        if self.metavar is not None:
            return str(self.metavar)
        if getattr(self, "is_flag", False):
            return None  # a flag takes no value
        label = str(core._TyperParameter.display_type(self, ctx) or "").strip("<>")
        label = label.removeprefix("list[").removesuffix("]")
        return _WORDS.get(label, label.upper()) or None

    argument, option = core.TyperArgument, core.TyperOption
    if hasattr(argument, "_usage_display_name") and hasattr(argument, "_rich_display_name"):
        setattr(argument, "_usage_display_name", usage_name)  # noqa: B010 - a patch, knowingly
        setattr(argument, "_rich_display_name", panel_name)  # noqa: B010
        setattr(argument, "display_type_rich", lambda self, ctx: None)  # noqa: B010
    if hasattr(option, "display_type_rich") and hasattr(core._TyperParameter, "display_type"):
        setattr(option, "display_type_rich", option_type)  # noqa: B010


#: what an option's value is, in words (Typer says the Python type)
_WORDS = {"str": "TEXT", "Path": "PATH", "path": "PATH", "int": "N", "float": "NUMBER"}


_plain_help()

app = typer.Typer(
    name="ciuic", no_args_is_help=True, add_completion=False,
    help="ciuic: the snapshot chain for PyTorch training.",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _console(stderr: bool = False) -> Console:
    """Rich output that wraps to the terminal, and not at all when it is not one (a pipe, a
    file, a test): digests and IDs must reach scripts whole."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=int(os.environ.get("COLUMNS", "0")) or 1000,
                   soft_wrap=True)


console = _console()
err = _console(stderr=True)

options: dict[str, Any] = {}


StoreOpt = Annotated[str | None, typer.Option(
    "--store", "-s", help="Store directory or URL (default: $CIUIC_HOME, else ./.ciuic).")]


@app.callback()
def _main(store: StoreOpt = None) -> None:
    options["store"] = store


def current_repo() -> Repository:
    from ciuic.chain.repo import default_location
    return open_existing(options.get("store") or default_location())


def open_existing(location: str) -> Repository:
    from ciuic.chain.repo import Repository
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

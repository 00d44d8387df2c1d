"""The Click application every command registers on, and what the commands share: the store
option, opening an existing store, sizes and times as people read them.

The help shows what to type, as command lines do (``restore SNAP --to PATH``, ``--steps N``),
each argument's help under "Arguments" (Click lists arguments in the usage line only), and each
command's whole first paragraph in the list of commands. Click rather than Typer: Typer builds
a pydantic adapter for every parameter and renders its help through ``rich.markdown``, which
alone take longer than the 0.3 s a command line that starts at once may (#19)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from rich.console import Console, ConsoleDimensions

from ciuic.errors import CiuicError
from ciuic.version import __version__

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID
    from rich.table import Table
    from rich.text import Text

    from ciuic.chain.repo import Repository
    from ciuic.format.info import SnapshotInfo


class Argument(click.Argument):
    """An argument with a help text, listed under "Arguments" in its command's help (Click
    takes an argument's help only from 8.5 on, and lists it elsewhere)."""

    def __init__(self, param_decls: Sequence[str], required: bool | None = None,
                 help: str = "", **attrs: Any) -> None:
        super().__init__(param_decls, required=required, **attrs)
        self.help = help

    def get_help_record(self, ctx: click.Context) -> tuple[str, str]:
        return (self.human_readable_name,
                (self.help or "") + ("  [required]" if self.required else ""))


def _format_help(command: click.Command, ctx: click.Context,
                 formatter: click.HelpFormatter) -> None:
    """Usage, help text, the arguments, the options, each with its help, then the commands."""
    command.format_usage(ctx, formatter)
    command.format_help_text(ctx, formatter)
    sections: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Options": []}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            kind = "Arguments" if isinstance(param, click.Argument) else "Options"
            sections[kind].append(record)
    for title, rows in sections.items():
        if rows:
            with formatter.section(title):
                formatter.write_dl(rows)
    if isinstance(command, click.Group):
        command.format_commands(ctx, formatter)
    command.format_epilog(ctx, formatter)


def _first_paragraph(command: click.Command) -> str:
    """What the list of commands says of one: its help's first paragraph, whole (Click's own
    list cuts it at the first sentence or at the line's end)."""
    text = command.short_help or command.help or ""
    return " ".join(text.split("\n\n", 1)[0].split())


class Command(click.Command):
    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _format_help(self, ctx, formatter)

    def get_short_help_str(self, limit: int = 45) -> str:
        return _first_paragraph(self)


class Group(click.Group):
    """Commands listed in the order they were registered; with no arguments, the help on
    standard output and exit status 2."""

    command_class = Command

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _format_help(self, ctx, formatter)

    def get_short_help_str(self, limit: int = 45) -> str:
        return _first_paragraph(self)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            click.echo(ctx.get_help(), color=ctx.color)
            ctx.exit(2)
        return super().parse_args(ctx, args)


F = TypeVar("F", bound=Callable[..., Any])


def argument(name: str, help: str, **attrs: Any) -> Callable[[F], F]:
    """``click.argument`` with a help text (:class:`Argument`)."""
    return click.argument(name, cls=Argument, help=help, **attrs)


options: dict[str, Any] = {}


@click.group("ciuic", cls=Group, no_args_is_help=True,
             help="ciuic: the snapshot chain for PyTorch training.",
             context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--store", "-s",
              help="Store directory or URL (default: $CIUIC_HOME, else ./.ciuic).")
@click.version_option(__version__, "--version", prog_name="ciuic", message="%(prog)s %(version)s")
def app(store: str | None) -> None:
    options["store"] = store


#: the width of output to a pipe or a file ($COLUMNS, where set, wins)
PIPE_COLUMNS = 100


class _PipeConsole(Console):
    """Output to a pipe or a file: ``$COLUMNS`` wide as it is when printing (Rich reads it
    once, when the console is made at import), else :data:`PIPE_COLUMNS`."""

    @property
    def size(self) -> ConsoleDimensions:
        columns = os.environ.get("COLUMNS", "")
        return ConsoleDimensions(int(columns) if columns.isdigit() and int(columns) > 0
                                 else PIPE_COLUMNS, 25)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        raise AttributeError("the width of output to a pipe follows $COLUMNS")


def _console(stderr: bool = False) -> Console:
    """Rich output that fits the terminal; to a pipe or a file (a log, ``make demo > file``),
    tables and rules fit 100 columns (or ``$COLUMNS``) and a printed line is never wrapped:
    digests and IDs must reach scripts whole (the tables keep them in columns that never
    wrap)."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return _PipeConsole(stderr=stderr, soft_wrap=True)


console = _console()
err = _console(stderr=True)


def fitted(text: str, indent: int = 0, *, markup: bool = True, to: Console | None = None
           ) -> Text:
    """``text`` (Rich markup unless ``markup`` is False) broken at its spaces to fit the
    console's width, each line after the first indented by ``indent``: output to a pipe is
    never wrapped by Rich, so that IDs reach scripts whole, and a word longer than a line (an
    ID, a path, a command) is left whole here too."""
    from rich.text import Text

    room = max((to or console).width, indent + 20)
    pieces: list[Text] = []
    for line in (Text.from_markup(text) if markup else Text(text)).split("\n", allow_blank=True):
        cuts: list[int] = []
        start, words = 0, False
        for word in re.finditer(r"\S+", line.plain):
            if words and word.end() - start > room - (indent if cuts else 0):
                cuts.append(word.start())
                start = word.start()
            words = True
        for n, piece in enumerate(line.divide(cuts)):
            piece.rstrip()
            pieces.append(Text(" " * indent) + piece if n else piece)
    return Text("\n").join(pieces)


def say(text: str, indent: int = 0, *, markup: bool = True, stderr: bool = False) -> None:
    """Print ``text`` :func:`fitted` to the width of standard output (or ``stderr``)."""
    to = err if stderr else console
    to.print(fitted(text, indent, markup=markup, to=to), soft_wrap=True)


def tensor_table(*headers: str) -> Table:
    """A table of tensors, one a row, the first column their paths; print it with
    :func:`print_table`. Nothing in it is cut: a word too long for its column is folded onto
    the next line."""
    from rich.table import Table

    table = Table(*headers)
    for column in table.columns:
        column.overflow = "fold"
    return table


def print_table(table: Table) -> None:
    """Print a :func:`tensor_table` to the console's width with its paths whole where they
    can be: the other columns wrap at their words first; where the paths still do not fit, the
    other columns are as narrow as their longest words, the paths take the rest (20 at least)
    and the longer ones are folded. (Rich alone narrows the widest column first: the paths.)"""
    from rich.measure import Measurement

    unbounded = console.options.update_width(1 << 20)  # a measure is clamped to its width

    def narrowest(renderable: Any) -> int:
        return Measurement.get(console, unbounded, renderable).minimum

    first, *others = table.columns
    if narrowest(table) <= console.width:
        first.no_wrap = True
    else:
        for column in others:
            column.width = max(narrowest(cell) for cell in [column.header, *column.cells])
        first.width = 1
        first.width = max(20, console.width - narrowest(table) + 1)
    console.print(table)


def store_location() -> str:
    """The store the command works on: --store, else $CIUIC_HOME, else ./.ciuic."""
    from ciuic.chain.home import default_location
    return options.get("store") or default_location()


def command(*args: str) -> str:
    """``ciuic ARGS`` as a person pastes it, with the ``--store`` this command was given
    (without it the pasted command would look in another store)."""
    import shlex

    store = options.get("store")
    words = ["ciuic", *(["--store", store] if store else []), *args]
    return " ".join(shlex.quote(w) for w in words)


def current_repo() -> Repository:
    return open_existing(store_location())


def resolve(snap: str, repo: Repository | None = None) -> tuple[Repository, SnapshotInfo]:
    """The snapshot ``snap`` names and the repository that holds it (in a server's storage,
    its project's store)."""
    repo = repo or current_repo()
    info = repo.resolve(snap)
    return repo.scope(info.project), info


def check_existing(location: str) -> None:
    """Refuse a local folder that holds no store (opening it would make a new, empty one)."""
    if "://" in str(location):
        return
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


def open_existing(location: str) -> Repository:
    from ciuic.chain.repo import Repository
    check_existing(location)
    return Repository.open(location)


def size_text(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def time_text(created: str | None) -> str:
    return created[:19].replace("T", " ") if created else "-"


progress_option = click.option(
    "--progress", is_flag=True,
    help="Say the progress on standard error also where it is not a terminal (a line per "
         "phase and per tenth of it); on a terminal a bar shows it anyway")


class Phases:
    """A command's progress by phase, on standard error: a bar per phase where it is a
    terminal; elsewhere, with ``lines`` (``--progress``), a line per phase and per tenth of it
    (``LABEL DONE/COUNT (DETAIL)``), for logs and CI."""

    def __init__(self, bar: Progress, lines: bool) -> None:
        self.bar, self.lines = bar, lines
        self.tasks: dict[str, TaskID] = {}
        self.said: dict[str, int] = {}  # the tenths of each phase said, as lines

    def update(self, label: str, done: int, count: int, detail: str = "") -> None:
        if self.bar.disable:
            tenth = done * 10 // count if count else 10
            if self.lines and self.said.get(label, -1) < tenth:
                self.said[label] = tenth
                aside = f" ({detail})" if detail else ""
                err.print(f"{label} {done}/{count}{aside}", highlight=False, markup=False)
            return
        if label not in self.tasks:
            self.tasks[label] = self.bar.add_task(label, total=count, size="")
        self.bar.update(self.tasks[label], completed=done, total=count, size=detail)


def progress_bar(sizes: bool = False) -> Progress:
    """A bar on standard error, gone when done (none where it is not a terminal); ``sizes``:
    with each task's ``size`` field.
    (``rich.progress`` is imported here: only the commands that draw a bar pay for it.)"""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )
    size = [TextColumn("{task.fields[size]}")] if sizes else []
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), *size,
                    TimeElapsedColumn(), console=err, transient=True,
                    disable=not err.is_terminal)  # to a pipe or a file, it left an empty line

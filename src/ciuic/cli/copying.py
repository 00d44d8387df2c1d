"""The commands that copy chains between stores: push, pull, copy (only what the destination
lacks, verified on arrival)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from ciuic.cli.app import (
    Phases,
    app,
    argument,
    current_repo,
    open_existing,
    progress_bar,
    progress_option,
    say,
    size_text,
    store_location,
)
from ciuic.errors import CiuicError
from ciuic.words import counted

if TYPE_CHECKING:

    from ciuic.chain.repo import Repository


def _copy(src: Repository, dst: Repository, jobs: list[tuple[str, str]], verify: bool,
          lines: bool = False) -> None:
    """Copy ``jobs``; progress on standard error: a bar where it is a terminal, else with
    ``lines`` (``--progress``) a line per phase and per tenth of it."""
    from ciuic.chain.transfer import CopyStats, copy_job

    total = CopyStats()
    with progress_bar(sizes=True) as bar:
        phases = Phases(bar, lines)
        for project, job in jobs:

            def tick(phase: str, done: int, count: int, sent: int, project: str = project,
                     job: str = job) -> None:
                phases.update(f"{project}/{job}: {phase}", done, count,
                              f"{size_text(sent)} sent")

            stats = copy_job(src.scope(project), dst.scope(project).store, project, job,
                             verify=verify, progress=tick)
            dst.sync_job(project, job)
            total.add(stats)
            pruned = (f" (and the manifests of {counted(stats.pruned, 'pruned one')}, which "
                      "keep the chain whole)" if stats.pruned else "")
            say(f"{project}/{job}: {counted(stats.snapshots, 'new snapshot')}{pruned}, "
                f"{counted(stats.sent, 'object')} sent ({size_text(stats.sent_bytes)}), "
                f"{stats.present} already there", 2)
            if stats.skipped_damaged:
                say(f"[yellow]{project}/{job}: "
                    f"{counted(stats.skipped_damaged, 'damaged manifest')} not copied; `ciuic "
                    "verify` names them[/yellow]", 2, stderr=True)
    if len(jobs) > 1:
        say(f"copied {len(jobs)} jobs: {counted(total.sent, 'object')}, "
            f"{size_text(total.sent_bytes)}", 2)


verify_option = click.option(
    "--verify/--no-verify", default=True,
    help="Read every object back from the destination and compare")


create_option = click.option(
    "--create", is_flag=True,
    help="Make a new store at the destination folder if it holds none (else refused: a "
         "mistyped path would make a stray store)")


def _destination(url: str, create: bool) -> Repository:
    """The store to copy into; a local folder that holds no store only with ``--create``."""
    from ciuic.chain.repo import Repository
    path = Path(url).expanduser()
    if not create and "://" not in url and not (path / "objects").is_dir():
        what = "holds no ciuic store" if path.exists() else "does not exist"
        raise CiuicError(f"{path.resolve()} {what}: check the destination, or pass --create "
                         "to make a new store there")
    return Repository.open(url)


@app.command("push")
@argument("job", help="PROJECT/JOB, or JOB if unique")
@argument("url", help="Destination store URL or directory")
@verify_option
@create_option
@progress_option
def push(job: str, url: str, verify: bool, create: bool, progress: bool) -> None:
    """Send a job's chain to another store, only what it lacks (e.g. s3://bucket/prefix)."""
    src = current_repo()
    project, name = src.split_job(job)
    _copy(src, _destination(url, create), [(project, name)], verify, progress)


@app.command("pull")
@argument("job", help="PROJECT/JOB, or JOB if unique there")
@argument("url", help="Source store URL or directory")
@verify_option
@progress_option
def pull(job: str, url: str, verify: bool, progress: bool) -> None:
    """Fetch a job's chain from another store into this one (created if needed)."""
    from ciuic.chain.repo import Repository
    from ciuic.chain.transfer import find_job

    src = open_existing(url)
    _copy(src, Repository.open(store_location()), [find_job(src, job)], verify, progress)


@app.command("copy")
@argument("src_url", help="Source store URL or directory")
@argument("dst_url", help="Destination store URL or directory")
@click.option("--job", "-j", multiple=True,
              help="PROJECT/JOB to copy (repeatable; default: every job)")
@verify_option
@create_option
@progress_option
def copy(src_url: str, dst_url: str, job: tuple[str, ...], verify: bool, create: bool,
         progress: bool) -> None:
    """Copy jobs' chains from one store to another, only what the destination lacks."""
    from ciuic.chain.transfer import find_job

    src = open_existing(src_url)
    jobs = [find_job(src, j) for j in job] if job else src.jobs()
    if not jobs:
        raise CiuicError(f"{src_url} holds no snapshots: nothing to copy")
    _copy(src, _destination(dst_url, create), jobs, verify, progress)

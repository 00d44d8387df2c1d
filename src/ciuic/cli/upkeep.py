"""The commands that change what a store keeps: prune, gc, reindex."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from ciuic.cli.app import (
    app,
    argument,
    command,
    current_repo,
    progress_bar,
    say,
    size_text,
    store_location,
)
from ciuic.errors import CiuicError, SnapshotNotFound
from ciuic.words import counted, listed

if TYPE_CHECKING:
    from ciuic.chain.repo import Repository
    from ciuic.format.info import SnapshotInfo


@app.command("prune")
@argument("job", help="PROJECT/JOB")
@click.option("--keep-last", type=click.IntRange(min=1), metavar="N",
              help="Keep the N highest steps")
@click.option("--keep-every", type=click.IntRange(min=1), metavar="K",
              help="Keep steps that are multiples of K")
@click.option("--snapshot", "named", multiple=True, metavar="SNAP",
              help="Prune this snapshot of the job, whatever the rules keep (a damaged one: "
              "a restore then starts from the one before it); repeatable")
@click.option("--dry-run/--no-dry-run", default=False, help="Only show what would go")
def prune(job: str, keep_last: int | None, keep_every: int | None, named: tuple[str, ...],
          dry_run: bool) -> None:
    """Prune a job's snapshots by retention rules, or by name (then run `ciuic gc` to free
    chunks). A pruned snapshot's manifest stays: the chain stays verifiable."""
    from ciuic.chain.retention import prune as prune_job
    from ciuic.chain.retention import prune_one
    if keep_last is None and keep_every is None and not named:
        raise CiuicError("say what to keep or drop: --keep-last N and/or --keep-every K, or "
                         "--snapshot SNAP")
    repo = current_repo()
    project, name = repo.split_job(job)
    repo.sync_job(project, name)
    scoped = repo.scope(project)
    chosen: dict[str, SnapshotInfo] = {}  # by ID: a snapshot named twice goes once
    for ref in named:
        info = _resolve_named(repo, ref, project, name)
        if (info.project, info.job) != (project, name):
            raise CiuicError(f"{ref} is a snapshot of {info.project}/{info.job}, not of "
                             f"{project}/{name}")
        if info.status == "pruned":
            say(f"{info.ref} ({info.short_id}) is pruned already", 2)
        else:
            chosen.setdefault(info.id, info)
    if not dry_run:
        for info in chosen.values():
            prune_one(scoped, info)
    doomed = list(chosen.values())
    if keep_last is not None or keep_every is not None:
        ruled = prune_job(scoped, project, name, keep_last, keep_every, dry_run=dry_run)
        doomed += [s for s in ruled if s.id not in chosen]
    verb = "would prune" if dry_run else "pruned"
    say(f"{verb} {counted(len(doomed), 'snapshot')}"
        + (": " + listed([s.step for s in doomed], "step") if doomed else "")
        + (f"; `{command('gc')}` frees the chunks only they used" if doomed and not dry_run
           else ""), 2)


def quarantine_place(key: str) -> str:
    """Where gc --quarantine moves ``key``: beside the store's other objects."""
    from ciuic.format.layout import QUARANTINE

    location = store_location()
    if "://" in location:
        return f"{QUARANTINE}{key} in {location}"
    return str(Path(location).expanduser() / "objects" / QUARANTINE / key)


def _resolve_named(repo: Repository, ref: str, project: str, job: str) -> SnapshotInfo:
    """The snapshot ``ref`` names; where the catalog lists none because its manifest is
    damaged (it lists only what it could read), the error says what removes it."""
    try:
        return repo.resolve(ref)
    except SnapshotNotFound:
        damaged = [i for i in repo.manifest_ids(project, job) if i.startswith(ref.strip())]
        if not damaged or len(ref.strip()) < 4:
            raise
        quarantine = command("gc", "--quarantine")
        raise CiuicError(f"{ref}: the manifest of snapshot {damaged[0][:12]} of {project}/{job} "
                         f"cannot be read, so it cannot be pruned; `{quarantine}` moves "
                         "damaged manifests aside") from None


@app.command("gc")
@click.option("--dry-run/--no-dry-run", default=False, help="Only count what would be deleted")
@click.option("--wait", type=click.FloatRange(min=0), default=30.0, metavar="SECONDS",
              help="Seconds to wait for saves in progress")
@click.option("--quarantine", is_flag=True,
              help="First move damaged manifests and bodies aside, to quarantine/ in the store "
              "(their snapshots cannot be restored either way); gc then frees what only they "
              "used")
def gc(dry_run: bool, wait: float, quarantine: bool) -> None:
    """Delete chunks and bodies no snapshot references. A damaged manifest keeps what it may
    reference (or, where that cannot be read, gc deletes nothing): each gc says so, and
    --quarantine ends it."""
    from ciuic.chain.gc import GcResult, collect
    from ciuic.store.local import spare_room
    if "://" not in store_location():  # a full disk: room to open the catalog, and the lock
        spare_room(Path(store_location()).expanduser() / "objects")
    repo = current_repo()
    result = GcResult()
    with progress_bar() as bar:
        task = bar.add_task("gc: reading manifests", total=None)
        for store in repo.namespaces():  # in a server's storage, each project's store too
            result.add(collect(store, dry_run=dry_run, wait_s=wait, quarantine_damaged=quarantine,
                               progress=lambda key: bar.advance(task)))
    verb = "would move" if dry_run else "moved"
    for key in result.quarantined:
        say(f"{verb} {key} to {quarantine_place(key)}", 2, markup=False)
    for d in result.damage:
        if d.key not in result.quarantined:
            say(f"[red]damaged: {d.key}[/red]: {d.reason}", 2, stderr=True)
    warning = result.warning(command("gc", "--quarantine"))
    if result.skipped:
        say(f"[yellow]gc skipped: {result.skipped}[/yellow]", 2, stderr=True)
        if warning:
            say(f"[yellow]{warning}[/yellow]", 2, stderr=True)
        raise click.exceptions.Exit(2)
    verb = "would delete" if dry_run else "deleted"
    say(f"{verb} {counted(result.deleted_chunks, 'chunk')} and "
        f"{counted(result.deleted_bodies, 'body', 'bodies')}, "
        f"{'freeing' if not dry_run else 'which would free'} "
        f"{size_text(result.deleted_bytes)}; kept {counted(result.kept_chunks, 'chunk')}", 2)
    if warning:
        say(f"[yellow]warning: {warning}[/yellow]", 2, stderr=True)


@app.command("reindex")
def reindex() -> None:
    """Rebuild the catalog from the store alone (the store is the truth)."""
    repo = current_repo()
    if repo.read_only:
        raise CiuicError(f"the store {repo.name} is on a read-only file system: its catalog "
                         "cannot be rebuilt, and nothing was written. Remount it read-write "
                         "and run reindex again (reading commands index it in your cache)")
    with progress_bar() as bar:
        task = bar.add_task("reindex", total=None)
        counts = repo.reindex(progress=lambda key: bar.advance(task))
    say(f"indexed {counted(counts['snapshots'], 'snapshot')} and {counts['pruned']} pruned; "
        f"{counted(counts['removed'], 'stale row')} removed; "
        f"{counted(counts['damaged'], 'damaged manifest')} skipped", 2)

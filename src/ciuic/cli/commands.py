"""The store's commands: ls, log, show, verify, restore, keygen, demo (push, pull and copy:
``copying``; prune, gc and reindex: ``upkeep``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ciuic.cli.app import (
    Phases,
    app,
    argument,
    check_existing,
    command,
    console,
    current_repo,
    err,
    open_existing,
    options,
    print_table,
    progress_bar,
    progress_option,
    resolve,
    say,
    size_text,
    store_location,
    tensor_table,
    time_text,
)
from ciuic.errors import CiuicError, IntegrityError, MissingKey, UnreadableObject
from ciuic.words import counted, listed, reasons_in_short

if TYPE_CHECKING:  # rich.table is imported by the commands that draw one: not by the help
    from collections.abc import Collection

    from rich.table import Table

    from ciuic.chain.repo import Repository
    from ciuic.chain.verify import Problem
    from ciuic.format.info import SnapshotInfo


JSON_HELP = "Print JSON (its fields: the README, \"Command line\")"


@app.command("ls")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def ls(as_json: bool) -> None:
    """List projects and jobs with their snapshot counts."""
    from rich import box
    from rich.table import Table

    from ciuic.chain.listing import read_jobs
    location = store_location()
    check_existing(location)
    rows = read_jobs(location)  # without SQLAlchemy, when the catalog is in sync
    damaged: list[UnreadableObject] = []
    if rows is None:
        repo = open_existing(location)
        for project, job in repo.jobs():
            repo.sync_job(project, job, damaged)
        rows = repo.catalog.jobs()
    if as_json:  # the server's shape (GET /v1/projects/P/jobs), every project's
        console.print_json(json.dumps({"jobs": [r.to_json() for r in rows]}))
        report_damaged(damaged)  # on standard error: the JSON stays whole
        return
    if not rows:
        console.print("No jobs yet.")
        report_damaged(damaged)
        return
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    t.add_column("job", no_wrap=True)
    for col in ("snaps", "last step"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("latest, UTC", no_wrap=True)
    t.add_column("stored", justify="right", no_wrap=True)
    for r in rows:
        last = "-" if r.max_step is None else str(r.max_step)
        t.add_row(f"{r.project}/{r.job}", str(r.snapshots), last, time_text(r.latest),
                  size_text(r.new_bytes))
    console.print(t)
    report_damaged(damaged)


def report_damaged(damaged: list[UnreadableObject]) -> None:
    """After a listing: each manifest it left out because it cannot be read; exit 1 if any."""
    for e in damaged:
        err.print(f"damaged, not listed: {e}", style="red", markup=False, highlight=False)
    if damaged:
        err.print("`ciuic verify` checks every snapshot; a restore skips a damaged one for the "
                  f"newest intact one before it; `{command('gc', '--quarantine')}` moves damaged "
                  "manifests aside", markup=False)
        raise click.exceptions.Exit(1)


@app.command("log")
@argument("job", help="PROJECT/JOB, or JOB if unique")
@click.option("--all", "all_", is_flag=True, help="Include pruned snapshots")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def log_cmd(job: str, all_: bool, as_json: bool) -> None:
    """Show a job's chain, newest first: step, time, size, new bytes, health (and why a
    snapshot is unhealthy, or damaged: a restore found it so and skipped it), and where runs
    were interrupted and resumed; one table per lineage."""
    from ciuic.chain.listing import EVENTS, read_log
    from ciuic.chain.retention import lineages
    from ciuic.chain.runs import damaged as found_damaged
    from ciuic.chain.runs import history
    location = store_location()
    check_existing(location)
    found = read_log(location, job)  # without SQLAlchemy, when the catalog is in sync
    damaged: list[UnreadableObject] = []
    if found is not None:
        project, name, every = found.project, found.job, found.snapshots
        runs, events = found.runs, found.events
    else:
        repo = open_existing(location)
        project, name = repo.split_job(job)
        repo.sync_job(project, name, damaged)
        every = repo.catalog.snapshots(project, name, status=None, newest_first=True)
        runs, events = repo.catalog.runs(project, name), repo.catalog.events(project, name,
                                                                             limit=EVENTS)
    snaps = [s for s in every if all_ or s.status == "committed"]
    notes = history(runs, events, every, listed_pruned=all_)
    unplaced = notes.pop("", [])  # failed snapshots before any listed one
    if not snaps and not as_json:
        console.print(f"Job {project}/{name} has no snapshots.")
        _print_failures(unplaced)
        report_damaged(damaged)
        return
    bad = found_damaged(events)
    groups = list(lineages(snaps, {s.id: s.parent for s in every}).values())
    groups.sort(key=lambda g: max(s.seq for s in g), reverse=True)  # the newest lineage first
    if as_json:  # newest first; lineage 1 is the oldest, as the tables number them
        console.print_json(json.dumps({"project": project, "job": name, "snapshots": [
            {**s.to_json(), "lineage": len(groups) - k, "notes": notes.get(s.id, []),
             "damaged": s.id in bad}
            for k, group in enumerate(groups)
            for s in sorted(group, key=lambda s: s.seq, reverse=True)],
            "failed": [{"run": e.run, "step": e.step, "at": e.at, "error": e.detail}
                       for e in sorted(events, key=lambda e: e.at) if e.kind == "failed"]}))
        report_damaged(damaged)
        return
    for k, group in enumerate(groups):
        title = f"{project}/{name}"
        if len(groups) > 1:
            root = min(group, key=lambda s: s.seq)
            title += (f": lineage {len(groups) - k} of {len(groups)}, from step {root.step} "
                      f"({root.short_id}, {time_text(root.created)} UTC)")
        console.print(_chain_table(title, group, notes, bad))
    _print_failures(unplaced)
    report_damaged(damaged)


def _print_failures(notes: list[str]) -> None:
    """Failed snapshots that no listed snapshot came before (``history``'s notes)."""
    for note in notes:
        console.print(f"Failed: {note}", markup=False)


def _chain_table(title: str, snaps: list[SnapshotInfo], notes: dict[str, list[str]],
                 bad: Collection[str] = ()) -> Table:
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
              collapse_padding=True)
    t.add_column("id", no_wrap=True, min_width=12)
    t.add_column("step", justify="right", no_wrap=True)
    t.add_column("time, UTC", no_wrap=True)
    for col in ("size", "new"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("parent", no_wrap=True)
    t.add_column("health", no_wrap=True)
    t.add_column("notes", min_width=10, overflow="fold")  # metrics, interruptions, reasons;
    # "pruned" when data is gone; a tensor's path longer than the column is folded, not cut
    for s in sorted(snaps, key=lambda s: s.seq, reverse=True):
        text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                        f"{k}={'nan' if v is None else v}"  # the catalog keeps NaN as null
                        for k, v in s.metrics.items())
        if s.status != "committed":
            text = f"{s.status} {text}".strip()
        reasons = list(s.health.reasons) if s.health is not None and not s.health.healthy else []
        if len(reasons) > 2:  # `ciuic inspect` lists them all
            reasons = [*reasons[:2], f"{len(reasons) - 2} more reasons: ciuic inspect "
                                     f"{s.short_id}"]
        text = "; ".join(x for x in [text, *reasons, *notes.get(s.id, [])] if x)
        t.add_row(s.short_id, str(s.step), time_text(s.created), size_text(s.total_bytes),
                  size_text(s.new_bytes), s.parent[:8] or "(root)",
                  "[red]damaged[/red]" if s.id in bad else
                  {None: "-", True: "[green]ok[/green]", False: "[red]unhealthy[/red]"}[
                      s.healthy], text)
    return t


SNAP_HELP = "ID, ID prefix, JOB@STEP, JOB@latest or JOB@healthy"


@app.command("show")
@argument("snap", help=SNAP_HELP)
@click.option("--json", "as_json", is_flag=True,
              help="Print the manifest and the tensors (tensor_list) as JSON")
def show(snap: str, as_json: bool) -> None:
    """Show one snapshot: its manifest and its tensors."""
    from ciuic.chain.read import read_body
    from ciuic.format.tree import walk_leaves
    repo, info = resolve(snap)
    m = repo.read_manifest(info.project, info.job, info.id)
    leaves = (walk_leaves(read_body(repo, info)[1]) if info.status == "committed" else [])
    if as_json:  # a pruned snapshot's tensors are gone: tensor_list is null
        console.print_json(json.dumps({"id": info.id, "status": info.status, **m.to_json(),
                                       "tensor_list": None if info.status != "committed" else [
                                           {"path": path, "dtype": str(desc["dtype"]),
                                            "shape": list(desc["shape"]),
                                            "nbytes": int(desc["nbytes"]),
                                            "stored": _pieces(desc)}
                                           for path, _kind, desc in leaves]}))
        return
    console.print(f"[bold]snapshot[/bold] {info.id}")
    for label, value in (("job", f"{m.project}/{m.job}"), ("step", m.step),
                         ("created", m.created), ("parent", m.parent or "(root)"),
                         ("size", f"{size_text(m.total_bytes)} ({size_text(m.new_bytes)} new)"),
                         ("tensors", m.tensors), ("ranks", m.world_size),
                         ("status", info.status), ("metrics", m.metrics or "-"),
                         ("health", "not recorded" if m.health is None else "healthy"
                          if m.health.healthy else "unhealthy: " + reasons_in_short(
                              m.health.reasons, info.ref))):
        say(f"  {label:8} {value}", 11, markup=False)
    if info.status != "committed":
        return
    t = tensor_table("tensor", "dtype", "shape", "bytes", "chunks")
    for path, _kind, desc in leaves:
        t.add_row(path, str(desc["dtype"]), str(tuple(desc["shape"])),
                  size_text(int(desc["nbytes"])),
                  _pieces(desc))
    print_table(t)


def _pieces(desc: dict[str, Any]) -> str:
    """How a tensor is stored: inline, N chunks, or S shards of N chunks in all."""
    if "shards" in desc:
        n = sum(len(s.get("chunks", [])) for s in desc["shards"])
        return f"{len(desc['shards'])} shards, {n} chunks"
    return "inline" if "inline" in desc else str(len(desc["chunks"]))


@app.command("verify")
@argument("target", required=False,
          help="A snapshot (ID, prefix, JOB@STEP) or a job (PROJECT/JOB); default: all")
@click.option("--deep/--no-deep", default=False, help="Re-read and re-hash every chunk")
@progress_option
def verify(target: str | None, deep: bool, progress: bool) -> None:
    """Check the chain: manifests, parent links, bodies and chunks (present; with --deep,
    re-read and re-hashed, which finds a damaged chunk)."""
    from ciuic.chain.verify import verify_job
    repo = current_repo()
    jobs: list[tuple[str, str, str | None]] = []
    if target is None:
        stored = repo.jobs()
        listed = {(r.project, r.job) for r in repo.catalog.jobs()  # with a snapshot
                  if r.latest is not None} - set(stored)
        if not stored:
            _nothing_stored(repo, sorted(listed))
        jobs = [(p, j, None) for p, j in sorted({*stored, *listed})]
    elif "@" in target or not _looks_like_job(repo, target):
        info = repo.resolve(target)
        jobs = [(info.project, info.job, info.id)]
    else:
        project, job = repo.split_job(target)
        jobs = [(project, job, None)]
    caches: dict[str, dict[str, Problem | None]] = {}  # a chunk's verdict, in its store
    bad = 0
    with progress_bar(sizes=True) as bar:
        phases = Phases(bar, progress)
        for project, job, only in jobs:

            def tick(phase: str, n: int, total: int, project: str = project,
                     job: str = job) -> None:
                phases.update(f"verify {project}/{job}: {phase}", n, total)

            scoped = repo.scope(project)
            report = verify_job(scoped, project, job, deep=deep, only=only,
                                _chunk_cache=caches.setdefault(scoped.name, {}), progress=tick)
            problems = report.problems or []
            lost = _not_stored(repo, project, job) if only is None else []
            bad += len(problems) + len(lost)
            damage = [p for p in problems if p.key_id is None]
            locked: dict[str, int] = {}  # a key not configured: one line, not one per object
            for p in problems:
                if p.key_id is not None:
                    locked[p.key_id] = locked.get(p.key_id, 0) + 1
            status = (f"[red]{counted(len(damage) + len(lost), 'problem')}[/red]"
                      if damage or lost else
                      "[green]ok[/green]" if not locked else "nothing damaged found")
            if locked:
                status += (f"; [yellow]{counted(sum(locked.values()), 'object')} could not be "
                           "checked[/yellow] (sealed with a key that is not configured)")
            aside = f", {report.quarantined} quarantined" if report.quarantined else ""
            say(f"{project}/{job}: {counted(report.snapshots, 'snapshot')} checked, "
                f"{report.pruned} pruned{aside}, {counted(report.chunks_checked, 'chunk')} "
                f"{'re-hashed' if deep else 'present'}: {status}", 2)
            if lost:
                say(f"  [red]the catalog lists {counted(len(lost), 'snapshot')} the store has "
                    f"no manifest of[/red] ({_steps(lost)}): {REINDEX}", 4)
            for p in damage:
                where = " ".join(x for x in (  # an unreadable manifest has no step
                    "" if p.step is None else f"step {p.step}", p.snapshot[:12]) if x)
                console.print(f"  [red]{where or 'the chain'}[/red]: {p.key}: {p.reason}",
                              highlight=False)
            _advise(project, job, damage)
            for key_id, n in locked.items():
                say(f"  [yellow]{counted(n, 'object')} sealed with key {key_id}[/yellow], which "
                    "is not configured, could not be checked:\n  set CIUIC_ENCRYPTION_KEY_FILE "
                    "(or CIUIC_ENCRYPTION_KEY) to it, or add it to CIUIC_DECRYPTION_KEYS", 4)
    if bad:
        raise click.exceptions.Exit(1)


def _advise(project: str, job: str, damage: list[Problem]) -> None:
    """What to do about a job's damage: a damaged manifest (its snapshot committed or pruned
    already) is moved aside by `ciuic gc --quarantine`; a committed snapshot's damaged body or
    chunk is pruned by name. (A broken link names its parent's manifest: moved aside too.)"""
    from ciuic.format import layout
    manifests = {p.key for p in damage if layout.parse_manifest(p.key) is not None}
    if manifests:
        say(f"  {counted(len(manifests), 'damaged manifest')}: "
            f"`{command('gc', '--quarantine')}` moves damaged manifests aside (to quarantine/ in "
            "the store); until then each gc keeps what they may reference, and says so", 4)
    data = [p for p in damage if p.key not in manifests and p.snapshot]
    if data:
        say(f"  a restore skips a damaged snapshot for the newest intact one before it; "
            f"`{command('prune', f'{project}/{job}', '--snapshot', data[0].snapshot[:12])}` "
            f"drops one (then `{command('gc')}` frees what only it used)", 4)


#: what to do about snapshots the catalog lists and the store lacks
REINDEX = ("point --store at the store that holds them, or run `ciuic reindex` to rebuild "
           "the catalog from this one (which forgets them)")


def _not_stored(repo: Repository, project: str, job: str) -> list[SnapshotInfo]:
    """The snapshots of a job the catalog lists and whose manifests its store lacks (a store
    moved without its objects). None with a mirror: it lists its fast tier only."""
    scoped = repo.scope(project)
    if len(scoped.store.copies()) > 1:
        return []
    stored = set(scoped.manifest_ids(project, job))
    return [s for s in scoped.catalog.snapshots(project, job, status=None) if s.id not in stored]


def _nothing_stored(repo: Repository, listed: list[tuple[str, str]]) -> None:
    """`ciuic verify` of a store with no snapshot: say so, and what its catalog lists (exit
    status 1 where it lists any)."""
    where = f"the store at {store_location()}"
    lost = {f"{p}/{j}": snaps for p, j in listed if (snaps := _not_stored(repo, p, j))}
    if not lost:
        say(f"nothing to verify: {where} holds no snapshots, and its catalog lists none")
        raise click.exceptions.Exit(0)
    say(f"[red]no snapshots found in {where}[/red]; its catalog lists "
        f"{sum(map(len, lost.values()))}: "
        + "; ".join(f"{job}: {_steps(snaps)}" for job, snaps in lost.items()) + f"\n{REINDEX}",
        2)
    raise click.exceptions.Exit(1)


def _steps(snaps: list[SnapshotInfo], most: int = 10) -> str:
    """``step 5``, ``steps 1, 2, 3``, or the first ``most`` and how many more."""
    return listed(sorted(s.step for s in snaps), "step", most=most)


def _looks_like_job(repo: Repository, text: str) -> bool:
    if "/" in text:
        return True
    return bool(repo.catalog.find_jobs(text))


@app.command("restore")
@argument("snap", help=SNAP_HELP)
@click.option("--to", "to", required=True, type=click.Path(path_type=Path),
              help="Output file (.safetensors, or .pt/.pth/.bin), or folder (--format hf)")
@click.option("--format", "fmt", help="safetensors, torch, or hf: a save_pretrained folder that "
              "from_pretrained loads (snapshots of CiuicTrainer)")
@click.option("--state", "states", multiple=True,
              help="A state to export (repeatable; default: model)")
@click.option("--force", is_flag=True, help="Replace the --to file if it exists")
def restore(snap: str, to: Path, fmt: str | None, states: tuple[str, ...], force: bool) -> None:
    """Export a snapshot's tensors as plain safetensors or torch file, or as an HF folder."""
    from ciuic.restore.export import export

    state = list(states) or None
    repo, info = resolve(snap)
    try:
        tensors = export(repo, info, to, fmt, state, replace=force)
    except MissingKey:
        raise  # not damage: its message names the key and how to configure it
    except IntegrityError as e:
        raise CiuicError(f"{e}\n{_intact_before(repo, info, to)}") from e
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    kind = fmt or ("safetensors" if to.suffix == ".safetensors" else "torch")
    wrote = f"Wrote {counted(len(tensors), 'tensor')} ({size_text(total)}"
    if kind == "hf":
        say(f"{wrote}) as a Hugging Face folder from {info.ref} ({info.short_id}) to {to} "
            f"(config.json, model.safetensors)\nload it with from_pretrained({str(to)!r})", 2,
            markup=False)
        return
    what = ("the model's" if not state else ", ".join(state))
    hints = ["torch.save's format: read it with torch.load"] if kind == "torch" else []
    if not state:
        hints.append("--state NAME exports another state (optimizer, ...)")
    say(f"{wrote}, {what}) in {kind} format from {info.ref} ({info.short_id}) to {to}"
        + "".join(f"\n{h}" for h in hints[:1]) + "".join(f"; {h}" for h in hints[1:]), 2,
        markup=False)


def _intact_before(repo: Repository, info: SnapshotInfo, to: Path, tries: int = 20) -> str:
    """Advice after a damaged snapshot: the newest earlier snapshot of the job whose body and
    chunks are intact (checked as `ciuic verify` does), as a command that exports it."""
    from ciuic.chain.verify import verify_job
    older = [s for s in repo.catalog.snapshots(info.project, info.job, newest_first=True)
             if s.seq < info.seq][:tries]
    locked, keys = 0, set[str]()  # earlier ones not checked: sealed with keys not configured
    for s in older:
        problems = verify_job(repo, s.project, s.job, only=s.id).problems
        if not problems:
            return (f"The newest intact snapshot before it is {s.ref} ({s.short_id}): "
                    + command("restore", s.short_id, "--to", str(to)))
        if all(p.key_id is not None for p in problems):  # not damaged: it may be intact
            locked += 1
            keys |= {str(p.key_id) for p in problems}
    if locked:
        return (f"{counted(locked, 'earlier snapshot')} could not be checked: sealed with key"
                f"{'s' if len(keys) > 1 else ''} {', '.join(sorted(keys))}, which "
                f"{'are' if len(keys) > 1 else 'is'} not configured; to find an intact one, "
                "set CIUIC_ENCRYPTION_KEY_FILE (or CIUIC_ENCRYPTION_KEY) or add "
                "CIUIC_DECRYPTION_KEYS")
    return (f"No intact snapshot before it was found; `"
            f"{command('verify', '--deep', f'{info.project}/{info.job}')}` names every damaged "
            "object")




@app.command("keygen")
def keygen() -> None:
    """Print a new encryption key (keep it secret and safe: without it, snapshots sealed
    with it cannot be read)."""
    from ciuic.format.crypto import generate_key_text, parse_key_text

    text = generate_key_text()
    err.print(f"key ID {parse_key_text(text).id}; use it with CIUIC_ENCRYPTION_KEY or "
              "CIUIC_ENCRYPTION_KEY_FILE", highlight=False)
    print(text)


@app.command("demo")
@click.option("--steps", type=int, default=300, metavar="N", help="Training steps")
@click.option("--save-every", type=int, default=20, metavar="N", help="Snapshot every N steps")
@click.option("--kill-at", type=int, metavar="N", help="Kill after this step (default: random)")
@click.option("--seed", type=int, metavar="N", help="Seed for the random kill step")
def demo(steps: int, save_every: int, kill_at: int | None, seed: int | None) -> None:
    """Train a small char-level GPT, SIGKILL it, resume, and check the weights bit for bit."""
    from ciuic.demo import run_demo

    if steps < save_every + 25:
        raise CiuicError(f"--steps must be at least --save-every + 25 ({save_every + 25})")
    result = run_demo(options.get("store"), steps=steps, save_every=save_every, kill_at=kill_at,
                      seed=seed, console=console)
    if not result.identical:
        raise click.exceptions.Exit(1)

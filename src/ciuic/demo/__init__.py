"""``ciuic demo``: train, crash hard, resume, and prove the result is bit-identical.

Three processes run the same char-level GPT training (:mod:`ciuic.demo.train`):

1. the reference, never interrupted and never snapshotted (in parallel with 2);
2. the same run with snapshots, which SIGKILLs itself at a random step;
3. a restart of 2, which finds the latest snapshot, resumes and finishes.

The final weights of 1 and 3 must be equal bit for bit.

May import: ``manager`` and everything below it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ciuic.chain.home import default_location
from ciuic.chain.repo import Repository


@dataclass
class DemoResult:
    identical: bool
    kill_at: int
    resumed_from: int | None
    reference: dict[str, Any]
    resumed: dict[str, Any]
    interrupted_rc: int
    job: str
    seconds: float
    #: how to train the job further by hand (it resumes from its latest snapshot)
    again: list[str] = field(default_factory=list)


def _cmd(store: str, job: str, steps: int, save_every: int, result: Path,
         extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "ciuic.demo.train", "--store", store, "--job", job,
            "--steps", str(steps), "--save-every", str(save_every), "--result", str(result),
            *extra]


def _stream(proc: subprocess.Popen[str], console: Console, prefix: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        console.print(f"[dim]{prefix}[/dim] {line.rstrip()}", highlight=False)
    proc.wait()


#: the training script's snapshot interval when it is not given (``--save-every``)
SAVE_EVERY = 20


def run_demo(store: str | None = None, steps: int = 300, save_every: int = SAVE_EVERY,
             kill_at: int | None = None, seed: int | None = None,
             console: Console | None = None) -> DemoResult:
    console = console or Console()
    given, store = store, store or default_location()
    rng = random.Random(seed)
    kill_at = kill_at if kill_at is not None else rng.randrange(save_every + 1, steps - 20)
    job = "chargpt-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    console.rule("[bold]ciuic demo: train, crash, resume, compare")
    console.print(f"Store: [cyan]{Path(store).resolve() if '://' not in store else store}[/cyan]"
                  f"   job: [cyan]demo/{job}[/cyan]   {steps} steps, a snapshot every "
                  f"{save_every} steps, SIGKILL after step [bold red]{kill_at}[/bold red]")
    children: list[subprocess.Popen[str]] = []

    def spawn(*args: Any, **kw: Any) -> subprocess.Popen[str]:
        children.append(subprocess.Popen(*args, **kw))
        return children[-1]

    # a SIGTERM to this process (not to its group) must not orphan the training processes
    on_term = (signal.signal(signal.SIGTERM, _exit_on_sigterm)
               if threading.current_thread() is threading.main_thread() else None)
    scratch = tempfile.TemporaryDirectory(prefix="ciuic-demo-")
    try:
        tmp = scratch.name
        ref_out, a_out, b_out = (Path(tmp) / n for n in ("ref.json", "a.json", "b.json"))
        console.print("\n[bold]1.[/bold] Uninterrupted reference run (no snapshots), in the "
                      "background")
        ref = spawn(_cmd(store, job + "-ref", steps, save_every, ref_out,
                         ["--no-snapshots"]),
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        console.print("[bold]2.[/bold] Training with snapshots; it will be killed hard")
        a = spawn(_cmd(store, job, steps, save_every, a_out, ["--kill-at", str(kill_at)]),
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        _stream(a, console, "  run 1 |")
        console.print(f"  [red]process ended with {_describe_rc(a.returncode)}[/red]")
        console.print("\n[bold]3.[/bold] Restarting the same command: ciuic resumes it")
        b = spawn(_cmd(store, job, steps, save_every, b_out, []),
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        _stream(b, console, "  run 2 |")
        _, ref_err = ref.communicate()
        if ref.returncode != 0 or b.returncode != 0:
            raise RuntimeError(f"demo training failed (reference rc={ref.returncode}, resumed "
                               f"rc={b.returncode}): {ref_err[-2000:]}")
        reference = json.loads(ref_out.read_text())
        resumed = json.loads(b_out.read_text())
    finally:
        if on_term is not None:  # a second SIGTERM must not cut the clean-up short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for child in children:  # before their folder goes
            _stop(child)
        scratch.cleanup()
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
    repo = Repository.open(store)
    try:
        snaps = repo.catalog.snapshots("demo", job)
    finally:
        repo.close()
    resumed["job_snapshots"] = len(snaps)
    resumed["job_total_bytes"] = sum(s.total_bytes for s in snaps)
    resumed["job_new_bytes"] = sum(s.new_bytes for s in snaps)
    result = DemoResult(
        identical=reference["digest"] == resumed["digest"], kill_at=kill_at,
        resumed_from=resumed["restored_step"], reference=reference, resumed=resumed,
        interrupted_rc=a.returncode, job=job, seconds=time.perf_counter() - t0,
        again=_again(store, job, steps + 100, save_every, default_store=given is None),
    )
    _summary(console, result)
    return result


def _again(store: str, job: str, steps: int, save_every: int, default_store: bool
           ) -> list[str]:
    """The command that trains the demo's job further, as the README shows it: the store and
    the interval only where they are not the training script's defaults."""
    cmd = [_here(sys.executable), "-m", "ciuic.demo.train"]
    if not default_store:
        cmd += ["--store", _here(store)]
    cmd += ["--job", job, "--steps", str(steps)]
    return cmd + ([] if save_every == SAVE_EVERY else ["--save-every", str(save_every)])


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _stop(child: subprocess.Popen[str]) -> None:
    """Stop a training process still running (it takes its emergency snapshot first)."""
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout=15)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _describe_rc(rc: int) -> str:
    return f"signal {-rc} (SIGKILL)" if rc == -9 else f"exit code {rc}"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _summary(console: Console, r: DemoResult) -> None:
    ref, res = r.reference, r.resumed
    table = Table(title="Summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    lost = r.kill_at - r.resumed_from if r.resumed_from is not None else r.kill_at + 1
    table.add_row("killed after step", str(r.kill_at))
    table.add_row("resumed from snapshot at step", str(r.resumed_from))
    table.add_row("steps lost (recomputed)", str(lost))
    table.add_row("time to resume (find, verify, load)", f"{res['restore_s'] * 1000:.0f} ms")
    table.add_row("snapshots in the job's chain", str(res["job_snapshots"]))
    table.add_row("new bytes written (all snapshots)", _mb(res["job_new_bytes"]))
    saved = res["job_total_bytes"] - res["job_new_bytes"]
    note = ("  (every weight changes every step here; frozen layers and fine-tunes dedup)"
            if saved < 0.01 * res["job_total_bytes"] else "")
    table.add_row("bytes saved by dedup", f"{_mb(saved)} of {_mb(res['job_total_bytes'])}{note}")
    table.add_row("final loss (reference / resumed)", f"{ref['loss']:.6f} / {res['loss']:.6f}")
    table.add_row("final weights BLAKE3 (reference)", ref["digest"][:32])
    table.add_row("final weights BLAKE3 (resumed)", res["digest"][:32])
    table.add_row("wall time", f"{r.seconds:.1f} s")
    console.print()
    console.print(table)
    if r.identical:
        console.print("[bold green]Bit-identical:[/bold green] the resumed run ended with exactly "
                      "the weights of the run that was never interrupted.")
    else:
        console.print("[bold red]MISMATCH:[/bold red] the resumed run's weights differ from the "
                      "reference run's.")
    console.print(f"Sample from the model: [italic]{res['sample']!r}[/italic]")
    cli = _cli_name()
    # one command a line, each whole (a command is copied as it is, whatever the width)
    console.print(f"Explore:\n  [cyan]{cli} log demo/{r.job}[/cyan]\n  [cyan]{cli} verify "
                  f"--deep demo/{r.job}[/cyan]\nTrain it further by hand (it resumes from its "
                  f"latest snapshot; stop it any way you like and run it again):\n  "
                  f"[cyan]{' '.join(r.again)}[/cyan]", highlight=False)


def _here(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    if "://" in path:
        return path
    full = os.path.abspath(path)  # not resolved: a venv's python is a link out of the venv
    rel = os.path.relpath(full)
    if rel.startswith(".."):
        return full
    return rel if os.sep in rel else os.path.join(".", rel)  # not looked up on PATH


def _cli_name() -> str:
    """How to call the command line from here: ``ciuic`` when it is on PATH, else its path."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "ciuic" and shutil.which("ciuic") != str(argv0.resolve()):
        return _here(str(argv0))
    return "ciuic" if shutil.which("ciuic") else f"{_here(sys.executable)} -m ciuic"

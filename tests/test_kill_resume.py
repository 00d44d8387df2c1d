"""End to end: kill a training subprocess anywhere, resume, and get bit-identical weights."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ciuic import knobs
from ciuic.chain.repo import Repository

from .conftest import TRAIN, run_train


def finish(store: Path, *args: str) -> tuple[str | None, int | None]:
    r = run_train(store, *args)
    assert r.rc == 0, r.err
    return r.digest, r.start


@pytest.mark.parametrize("failpoint, resume_at", [
    ("chunk.put=kill@1", 0),         # first chunk of the first save: nothing committed
    # in the middle of the second save (step 5): with packs, each save's small pieces are one
    (f"chunk.put=kill@{2 if knobs.get().pack_bytes else 12}", 1),
    ("chunks.sync=kill@2", 1),       # second save's chunks written, not yet synced
    ("body.put=kill@2", 1),          # all chunks of the second save written, no body
    ("manifest.create=kill@3", 6),   # third save's data written, not committed
    ("catalog.insert=kill@2", 6),    # committed, catalog row missing: healed, resumes at 5
])
def test_kill_at_every_failpoint_resumes_bit_exact(tmp_path: Path, reference_digest: str,
                                                   failpoint: str, resume_at: int) -> None:
    store = tmp_path / "store"
    crashed = run_train(store, env={"CIUIC_FAILPOINTS": failpoint})
    assert crashed.rc == -signal.SIGKILL, crashed.err
    digest, start = finish(store)
    assert start == resume_at
    assert digest == reference_digest


def test_resume_twice_in_a_row(tmp_path: Path, reference_digest: str) -> None:
    store = tmp_path / "store"
    assert run_train(store, "--sync", "--kill-at", "13").rc == -signal.SIGKILL
    r = run_train(store, "--sync", "--kill-at", "27")
    assert r.rc == -signal.SIGKILL and r.start == 11
    assert "Detected training interruption" in r.err
    digest, start = finish(store)
    assert start == 26
    assert digest == reference_digest


def test_death_before_the_background_write_finishes(tmp_path: Path,
                                                    reference_digest: str) -> None:
    """step() returned (the state is staged) but the process dies while the snapshot is still
    being written: nothing is published, and the restart resumes from the previous snapshot,
    not from step 0."""
    store = tmp_path / "store"
    slow = {"CIUIC_FAILPOINTS": "chunk.put=sleep:0.2"}
    crashed = run_train(store, "--kill-at", "11", env=slow)
    assert crashed.rc == -signal.SIGKILL
    assert "STEP 11" in crashed.out  # step(10) had returned: its snapshot was staged
    repo = Repository.open(store)
    assert [s.step for s in repo.catalog.snapshots("tests", "mlp")] == [0, 5]
    digest, start = finish(store)
    assert start == 6
    assert digest == reference_digest


def random_kill_loop(tmp_path: Path, rounds: int, seed: int, steps: int = 60) -> dict[str, int]:
    """SIGKILL the job from outside at random moments, ``rounds`` times, then let it finish.

    Chunk writes are slowed down (a ``sleep`` failpoint) so that about half of the run is spent
    inside saves; a kill that leaves an in-flight marker behind hit a save. Every restart must
    resume from a complete snapshot and the final state must equal the uninterrupted run's.
    """
    store = tmp_path / "store"
    ref = run_train(tmp_path / "ref", "--steps", str(steps), "--no-snapshots")
    rng = random.Random(seed)
    stats = {"rounds": rounds, "kills": 0, "kills_in_save": 0, "resumes": 0, "mismatches": 0}
    env = {k: v for k, v in os.environ.items() if k != "CIUIC_HOME"}
    env["CIUIC_FAILPOINTS"] = "chunk.put=sleep:0.06"
    last_start = -1
    markers: set[Path] = set()
    for _ in range(rounds):
        proc = subprocess.Popen(
            [sys.executable, str(TRAIN), "--store", str(store), "--steps", str(steps),
             "--save-every", "3", "--sleep-in-step", "0.01"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "START n": torch imported, state restored
        assert line.startswith("START"), line
        start = int(line.split()[1])
        if start > 0:
            stats["resumes"] += 1
        assert start >= last_start, "resumed from an older snapshot than the previous round"
        last_start = start
        time.sleep(rng.uniform(0.0, 0.8))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.returncode == -signal.SIGKILL:
            stats["kills"] += 1
            now = set((store / "objects" / "inflight").glob("*.json"))
            stats["kills_in_save"] += bool(now - markers)  # a marker this round left behind
            markers = now
    r = run_train(store, "--steps", str(steps))
    assert r.rc == 0, r.err
    stats["mismatches"] = int(r.digest != ref.digest)
    print(f"\nrandom kill loop: {stats}")
    return stats


def test_random_sigkills_from_outside(tmp_path: Path) -> None:
    stats = random_kill_loop(tmp_path, rounds=10, seed=1)
    assert stats["kills"] >= 8
    assert stats["kills_in_save"] >= 1
    assert stats["mismatches"] == 0


@pytest.mark.slow
@pytest.mark.long  # test_random_sigkills_from_outside kills in CI
@pytest.mark.timeout(1800)  # 20 kill-and-restart rounds: longer than the suite's 300 s per test
def test_random_sigkills_long(tmp_path: Path) -> None:
    stats = random_kill_loop(tmp_path, rounds=20, seed=2, steps=200)
    assert stats["kills_in_save"] >= 5
    assert stats["mismatches"] == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_takes_an_emergency_snapshot_and_exits(tmp_path: Path, reference_digest: str,
                                                      sig: signal.Signals) -> None:
    store = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN), "--store", str(store), "--sleep-in-step", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if k != "CIUIC_HOME"})
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "STEP 12":
            proc.send_signal(sig)
            break
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert f"{sig.name} received" in err
    assert "Emergency snapshot at step 13" in err  # the step after which the signal was seen
    repo = Repository.open(store)
    assert repo.catalog.latest("tests", "mlp").step == 13  # type: ignore[union-attr]
    r = run_train(store)
    assert r.rc == 0 and r.start == 14
    assert f"stopped by {sig.name}" in r.err
    assert r.digest == reference_digest

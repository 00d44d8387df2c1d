"""Two writers on one job: the newer one takes over, the older one can never commit again."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ciuic import SnapshotManager
from ciuic.errors import FencedOut
from ciuic.store import LocalStore
from tests.models import model_opt


def test_a_taken_over_writer_can_never_commit(store_dir: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    model, opt = model_opt(16, 16)
    old = SnapshotManager("p", job="two", store=store_dir, save_interval=1)
    assert old.step(0, model, opt)
    old.wait()
    with caplog.at_level(logging.WARNING, logger="ciuic"):
        new = SnapshotManager("p", job="two", store=store_dir, save_interval=1)
    assert "may still be running in another process" in caplog.text
    assert "takes the job over" in caplog.text and "Stop it" in caplog.text
    assert new.lease.token == old.lease.token + 1
    assert new.restore(model, opt) == 0

    assert old.step(1, model, opt)  # staged; the commit is refused in the background
    old.wait()
    assert old.stats.failures == 1
    assert "another process took over job p/two" in old.stats.last_error
    assert "Stop this process" in old.stats.last_error
    assert any(r.levelno == logging.CRITICAL for r in caplog.records)
    with pytest.raises(FencedOut, match="may no longer commit"):
        old.save(2, model, opt)

    assert new.step(1, model, opt)
    new.wait()
    assert new.stats.failures == 0
    steps = [s.step for s in new.repo.catalog.snapshots("p", "two")]
    assert steps == [0, 1]  # nothing from the fenced writer
    assert new.latest().parent == new.repo.catalog.snapshots("p", "two")[0].id  # type: ignore[union-attr]
    old.close()
    new.close()


def test_local_store_lock_is_exclusive_across_processes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "o")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom ciuic.store import LocalStore\n"
         f"s = LocalStore({str(tmp_path / 'o')!r})\n"
         "with s.lock('jobs/p/j/commit'):\n    print('held', flush=True)\n    time.sleep(1.0)\n"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "held"
    t0 = time.perf_counter()
    with store.lock("jobs/p/j/commit"):
        waited = time.perf_counter() - t0
    holder.wait()
    assert waited > 0.5, f"the lock was not exclusive (waited {waited:.2f} s)"
    assert list(store.list()) == []  # lock files are not objects


def test_lease_tokens_compare_as_numbers_past_twelve_digits(tmp_path: Path) -> None:
    """Found by review (#43): a lease 999999999999 (forged, or simply reached) blocked its job
    for good: the next token's key, 1000000000000, sorts before it as a string."""
    from dataclasses import replace

    from ciuic.chain.lease import acquire, check
    from ciuic.format import layout

    store = LocalStore(tmp_path / "objects")
    assert store.create(layout.lease_key("p", "j", 999_999_999_999), b"{}")
    newer = acquire(store, "p", "j", "run-b")
    assert newer.token == 1_000_000_000_000
    assert newer.key == "jobs/p/j/leases/1000000000000.json"
    check(store, newer)  # the newest: it may commit
    older = replace(newer, token=999_999_999_999)
    with pytest.raises(FencedOut, match="another process took over job p/j"):
        check(store, older)
    assert acquire(store, "p", "j", "run-c").token == 1_000_000_000_001
    with pytest.raises(FencedOut):
        check(store, newer)
    store.close()


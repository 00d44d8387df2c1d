"""A job that ends cleanly ends with its final state in the chain: close() (and leaving a with
block normally) snapshots the last step given to step() when no snapshot holds it yet; leaving
by an exception does not."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from ciuic import SnapshotManager
from tests.models import model_opt


def train(m: SnapshotManager, steps: range, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for step in steps:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        m.step(step, model, opt)


parts = partial(model_opt, 4, 2)


def test_a_clean_end_snapshots_the_last_step(store_dir: Path) -> None:
    model, opt = parts()
    with SnapshotManager("p", job="j", store=store_dir, save_interval=5) as m:
        train(m, range(40), model, opt)
    with SnapshotManager("p", job="j", store=store_dir) as again:
        steps = [s.step for s in again.repo.catalog.snapshots("p", "j")]
        assert steps == [0, 5, 10, 15, 20, 25, 30, 35, 39]
        fresh, fresh_opt = parts()
        assert again.restore(fresh, fresh_opt) == 39  # a rerun trains nothing twice
        assert torch.equal(fresh.weight, model.weight)


def test_close_takes_no_second_snapshot_of_a_snapshotted_step(store_dir: Path) -> None:
    model, opt = parts()
    m = SnapshotManager("p", job="k", store=store_dir, save_interval=5)
    train(m, range(11), model, opt)  # step 10 is a snapshot step
    m.close()
    m.close()  # idempotent
    with SnapshotManager("p", job="k", store=store_dir) as again:
        assert [s.step for s in again.repo.catalog.snapshots("p", "k")] == [0, 5, 10]


def test_an_exception_leaves_no_final_snapshot(store_dir: Path) -> None:
    model, opt = parts()
    with pytest.raises(RuntimeError, match="diverged"), SnapshotManager(
            "p", job="x", store=store_dir, save_interval=5) as m:
        train(m, range(8), model, opt)
        raise RuntimeError("loss diverged")
    with SnapshotManager("p", job="x", store=store_dir) as again:
        assert [s.step for s in again.repo.catalog.snapshots("p", "x")] == [0, 5]


def test_close_without_a_final_snapshot_when_asked(store_dir: Path) -> None:
    model, opt = parts()
    m = SnapshotManager("p", job="y", store=store_dir, save_interval=5)
    train(m, range(3), model, opt)
    m.close(final=False)
    with SnapshotManager("p", job="y", store=store_dir) as again:
        assert [s.step for s in again.repo.catalog.snapshots("p", "y")] == [0]


def test_the_framework_decides_with_step_snapshot(store_dir: Path) -> None:
    model, opt = parts()
    with SnapshotManager("p", job="j", store=store_dir, save_interval=5,
                         asynchronous=False) as m:
        took = [m.step(s, model, opt, snapshot=s in (3, 7)) for s in range(1, 11)]
        assert took == [s in (3, 7) for s in range(1, 11)]  # save_interval=5 does not count
        assert m.step(7, model, opt, snapshot=True) is False  # already the latest
        assert m.step(11, model, opt) is False and m.step(15, model, opt) is True  # default
        with pytest.raises(TypeError, match="True, False or None"):
            m.step(16, model, opt, snapshot="yes")  # type: ignore[arg-type]
        assert m.step(16, model, opt) is False
        info = m.finish()  # the end of training, manager still open
        assert info is not None and info.step == 16
        assert m.finish() == info  # nothing new to snapshot
        m.step(17, model, opt, snapshot=False)
    with SnapshotManager("p", job="j", store=store_dir) as again:
        assert [s.step for s in again.repo.catalog.snapshots("p", "j")] == [3, 7, 15, 16, 17]


SCRIPT = """
import sys
import torch
from torch import nn
from ciuic import SnapshotManager

torch.manual_seed(0)
model = nn.Linear(512, 512)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
m = SnapshotManager("p", job="noclose", store=sys.argv[1], save_interval=5)
for step in range(6):  # step 5's snapshot is still being written when the script ends
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    m.step(step, model, opt)
"""


def test_a_script_that_never_closes_still_commits_the_snapshot_in_flight(
        store_dir: Path, tmp_path: Path) -> None:
    """As the seed's example does: no close(), no with block. The write in flight at exit
    failed ('cannot schedule new futures after interpreter shutdown')."""
    import subprocess
    import sys

    from ciuic.chain.repo import Repository

    script = tmp_path / "noclose.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(store_dir)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "failed" not in run.stderr, run.stderr
    with Repository.open(store_dir) as repo:
        assert [s.step for s in repo.catalog.snapshots("p", "noclose")] == [0, 5]

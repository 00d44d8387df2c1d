"""A snapshot that fails the same way every time raises at once; a job whose snapshots failed
says so at its end (issue 44: a job trained for hours with every snapshot failing exited 0)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ciuic import SnapshotManager, faults
from ciuic.errors import CaptureError


class Broken(nn.Linear):
    """A module whose state-dict hook raises (as DCP did on torchtitan's fused QKV)."""

    def __init__(self, error: type[Exception] = AttributeError) -> None:
        super().__init__(4, 4)
        self.error = error
        self.register_state_dict_post_hook(self._hook)

    @staticmethod
    def _hook(module: Any, state: dict[str, Any], prefix: str, _: Any) -> None:
        raise module.error("'Broken' object has no attribute 'wq'")


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_state_that_cannot_be_captured_raises_at_the_first_snapshot(
        store_dir: Path, asynchronous: bool) -> None:
    model = Broken()
    with SnapshotManager("p", job="broken", store=store_dir, save_interval=2,
                         asynchronous=asynchronous) as m:
        with pytest.raises(CaptureError) as raised:
            m.step(1, model)  # not due: the first step() given state checks it can be captured
        message = str(raised.value)
        assert "AttributeError: 'Broken' object has no attribute 'wq'" in message
        assert "fails the same way at every snapshot" in message
        assert isinstance(raised.value.__cause__, AttributeError)  # the traceback is kept
        with pytest.raises(CaptureError):
            m.step(2, model)  # due
        assert m.latest() is None


def test_an_environment_fault_while_capturing_is_a_failed_snapshot_and_training_goes_on(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = Broken(OSError)
    with SnapshotManager("p", job="env", store=store_dir, save_interval=1,
                         asynchronous=False) as m:
        assert m.step(0, model) is False
        assert m.stats.failures == 1
    assert "snapshot at step 0 failed" in caplog.text


def test_the_end_of_a_run_says_how_many_snapshots_failed_and_the_latest(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(4, 4)
    with caplog.at_level(logging.WARNING, logger="ciuic"), SnapshotManager(
            "p", job="faulty", store=store_dir, save_interval=1) as m:
        m.step(0, model)
        m.wait()
        faults.reload("body.put=raise")
        try:
            for step in (1, 2):
                with torch.no_grad():
                    model.weight.add_(1)
                m.step(step, model)
                m.wait()
        finally:
            faults.reload("")
        caplog.clear()
        m.close(final=False)
    ends = [r.getMessage() for r in caplog.records if "of this run's" in r.getMessage()]
    assert len(ends) == 1, caplog.text
    assert ends[0].startswith("2 snapshots of this run's 3 failed, the last at step 2 (")
    assert "failpoint body.put" in ends[0]
    assert ends[0].endswith("the latest committed snapshot is step 0")


def test_a_clean_run_says_nothing_at_its_end(store_dir: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ciuic"), SnapshotManager(
            "p", job="clean", store=store_dir, save_interval=1) as m:
        m.step(0, nn.Linear(2, 2))
    assert "of this run's" not in caplog.text


def test_on_two_ranks_a_hook_failing_on_one_raises_on_both_at_that_step(tmp_path: Path) -> None:
    from tests.framework_runs import free_port

    helper = Path(__file__).parent / "helpers" / "hooked_models.py"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(helper), str(tmp_path / "store"),
         str(tmp_path), "broken"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    said = [(tmp_path / f"broken-rank{rank}.txt").read_text() for rank in (0, 1)]
    # both at one step (the next agreement of the ranks), not at whichever step each learnt it
    assert said[0].split(":")[0] == said[1].split(":")[0], said
    assert int(said[0].split(":")[0].removeprefix("step ")) <= 3 + 10, said
    for text in said:
        assert (": CaptureError: snapshot at step 3 failed on 1 rank: rank 1: CaptureError: "
                "capturing the state for the snapshot failed: AttributeError: 'Linear' object "
                "has no attribute 'wq'") in text, text


FAULTY_JOB = """
import sys
import torch
from torch import nn
from ciuic import SnapshotManager, faults

model = nn.Linear(4, 2)
with SnapshotManager("p", job="faulty", store=sys.argv[1], save_interval=1) as m:
    for step in range(6):
        faults.reload("body.put=raise" if step in (2, 3) else "")  # a storage fault
        with torch.no_grad():
            model.weight.add_(1)
        m.step(step, model)
        m.wait()
"""


def ciuic_log(store: Path, *options: str) -> str:
    run = subprocess.run([sys.executable, "-m", "ciuic", "--store", str(store), "log", *options,
                          "p/faulty"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "400"})
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_ciuic_run_s_summary_and_ciuic_log_name_the_failed_snapshots(tmp_path: Path) -> None:
    job, store = tmp_path / "job.py", tmp_path / "store"
    job.write_text(FAULTY_JOB)
    run = subprocess.run(
        [sys.executable, "-m", "ciuic", "run", "--host-memory", "off", "--", sys.executable,
         str(job), str(store)], capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("[WARNING] ciuic run: the job finished (exit 0). Its snapshots: 4 committed, the "
            "last at step 5; 2 failed, the last at step 3 (`ciuic log` lists them)"
            ) in run.stderr, run.stderr[-3000:]
    shown = ciuic_log(store)
    line = next(x for x in shown.splitlines() if "failed" in x)
    assert re.match(r"\s*\w{12}\s+1\s", line), shown  # on the snapshot before them: step 1
    assert re.search(r"then 2 snapshots of run \w{8} failed, at steps 2 to 3: failpoint "
                     r"body\.put: injected I/O error", line), shown
    listed = json.loads(ciuic_log(store, "--json"))
    assert [(f["step"], f["error"]) for f in listed["failed"]] == [
        (s, "failpoint body.put: injected I/O error") for s in (2, 3)]


def test_ciuic_log_of_a_job_whose_every_snapshot_failed_says_so(store_dir: Path) -> None:
    model = nn.Linear(4, 4)
    with SnapshotManager("p", job="faulty", store=store_dir, save_interval=1) as m:
        faults.reload("body.put=raise")
        try:
            for step in range(3):
                m.step(step, model)
                m.wait()
        finally:
            faults.reload("")
        m.close(final=False)
    shown = ciuic_log(store_dir)
    assert "Job p/faulty has no snapshots." in shown, shown
    assert re.search(r"Failed: 3 snapshots of run \w{8} failed, at steps 0 to 2: failpoint "
                     r"body\.put: injected I/O error", shown), shown


def test_ciuic_run_counts_a_snapshot_once_however_many_ranks_took_it() -> None:
    from ciuic.supervisor.starts import Start, snapshots_said

    first, second = Start(0, 0.0), Start(1, 0.0)
    # two ranks, then torchrun's second generation of them within the first start
    first.generation_of = {10: 1, 11: 1, 20: 2, 21: 2}
    first.snapshots = {10: (3, 1, 4), 11: (3, 1, 4), 20: (2, 0, None), 21: (1, 1, 9)}
    first.committed = 8
    second.snapshots = {30: (5, 0, None), 31: (5, 0, None)}
    second.committed = 20
    assert snapshots_said([first, second]) == (
        "10 committed, the last at step 20; 2 failed, the last at step 9 (`ciuic log` lists "
        "them)", True)
    assert snapshots_said([Start(0, 0.0)]) == ("none committed", False)

"""In-process recovery (#46) inside the frameworks' own loops: Hugging Face's Trainer
(``CiuicTrainer``) and Lightning's (``CiuicCallback``), 2 DDP ranks under ``ciuic run
--nproc-per-node 2``, the framework's whole set-up and fit in a function wrapped in
``ciuic.recoverable`` (tests/helpers/ip_hf_train.py, ip_pl_train.py). A rank killed (a warm
spare takes its place) or raising at a step's end: the other rank stays in its process, the
framework's objects (accelerate's state, Lightning's strategy and its process group) are built
again in the next generation, and the job ends with every tensor equal to an uninterrupted
run's under the same launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_supervisor import CIUIC, assert_same, final

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="ciuic run needs Linux")]
HELPERS = Path(__file__).parent / "helpers"
SCRIPTS = {"hf": HELPERS / "ip_hf_train.py", "lightning": HELPERS / "ip_pl_train.py"}


def launch(framework: str, out: Path, *args: str,
           run_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("transformers" if framework == "hf" else "lightning")
    return subprocess.run(
        [*CIUIC, "run", "--nproc-per-node", "2", *run_args, "--", sys.executable,
         str(SCRIPTS[framework]), "--out", str(out), *args],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each framework's job run through without a fault, run once when first asked for."""
    runs: dict[str, Path] = {}

    class Lazy(dict[str, Path]):
        def __missing__(self, framework: str) -> Path:
            out = tmp_path_factory.mktemp(f"ref-{framework}")
            run = launch(framework, out)
            assert run.returncode == 0, run.stderr[-4000:]
            self[framework] = out
            return out

    return Lazy(runs)


@pytest.mark.parametrize(("framework", "fault", "run_args"), [
    # (all long, for CI's hour: the frameworks run inside the wrapper as they are, with no
    # code of ciuic's of their own; tests/test_inprocess.py covers the mechanism in CI)
    pytest.param("hf", "17:0:kill", ("--spares", "1"), marks=pytest.mark.long),
    pytest.param("hf", "12:1:raise", (), marks=pytest.mark.long),
    pytest.param("lightning", "17:1:raise", (), marks=pytest.mark.long),
    pytest.param("lightning", "12:0:kill", ("--spares", "1"), marks=pytest.mark.long),
])
def test_a_frameworks_loop_recovers_in_the_survivors_process_bit_exact(
        tmp_path: Path, uninterrupted: dict[str, Path], framework: str, fault: str,
        run_args: tuple[str, ...]) -> None:
    run = launch(framework, tmp_path, "--fault", fault, run_args=run_args)
    assert run.returncode == 0, run.stderr[-5000:]
    step, rank, action = fault.split(":")
    err = run.stderr
    assert f"injected {action} at step {step} (rank {rank})" in err, err[-4000:]
    stay = "1 rank stays in its process" if action == "kill" else \
        "2 ranks stay in their processes"  # (the rank that raised too)
    assert f"Generation 1: {stay}" in err, err[-4000:]
    if run_args:
        assert f"rank {rank} goes to warm spare 0" in err, err[-4000:]
    assert "after 1 in-process recovery" in err, err[-3000:]
    resumed = "Resuming the Trainer after global step" if framework == "hf" else \
        "Resuming the Lightning fit after global step"
    assert resumed in err, err[-4000:]
    ref: dict[str, torch.Tensor] = final(uninterrupted[framework])
    assert_same(final(tmp_path), ref)

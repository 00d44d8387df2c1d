"""What the framework integration tests share: a run's outcome, the final state a helper job
writes (tests/helpers/hf_train.py, pl_train.py), and how two final states differ."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(helper: Path, out: Path, *args: str, ranks: int = 1, failpoints: str = "",
           env: dict[str, str] | None = None, timeout: float = 300
           ) -> subprocess.CompletedProcess[str]:
    """Run a helper job with ``--out OUT ARGS``: one process, or ``ranks`` under torchrun."""
    command = [sys.executable]
    if ranks > 1:
        command += ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                    "--master_port", str(free_port())]
    environ = {**os.environ, "CIUIC_FAILPOINTS": failpoints, "PYTHONWARNINGS": "ignore",
               **(env or {})}
    return subprocess.run([*command, str(helper), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, env=environ)


def sigkilled(run: subprocess.CompletedProcess[str]) -> None:
    """The run died of the test's SIGKILL (a process, or a worker under torchrun), not of
    something else that a later resume would hide (a port taken, a crash: the resume then
    starts from scratch and the test fails far from the cause)."""
    assert run.returncode == -9 or (run.returncode != 0 and "(SIGKILL)" in run.stderr), (
        run.returncode, run.stdout[-2000:] + run.stderr[-4000:])


def finished(run: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


#: what ciuic's integrations resume: each says "Resuming the WHAT after global step N"
INTEGRATIONS = ("Trainer", "Lightning fit", "Accelerate loop", "DeepSpeed loop", "Megatron loop")


def resumed_at(run: subprocess.CompletedProcess[str] | str, what: str, *,
               own: bool = False) -> int:
    """The global step N the run (its standard error, or a log's text) says it resumed after.
    ciuic's integrations (``what`` in INTEGRATIONS) say "after global step N" (the snapshot's,
    done), and ciuic's "Resuming training at step N+1" beside it names the next step: one user
    read "step 31" then "global step 30" as a disagreement (issue 30), so both are required.
    The test helpers' own loops (torchtitan's, a framework's own resume: ``own``) say "at"."""
    text = run if isinstance(run, str) else run.stderr
    ours = what in INTEGRATIONS and not own
    found = re.search(rf"Resuming the {what} {'after' if ours else 'at'} global step (\d+)",
                      text)
    assert found, text[-3000:]
    step = int(found.group(1))
    if ours:
        nxt = re.search(r"Resuming training at step (\d+)", text)
        assert nxt is not None and int(nxt.group(1)) == step + 1, text[-3000:]
    return step


def final(out: Path, mode: str = "ciuic") -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor the job wrote at its end, by name."""
    from safetensors.torch import load_file

    loaded: dict[str, torch.Tensor] = load_file(str(out / f"final-{mode}.safetensors"))
    return loaded


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """The tensors that are not torch.equal, with their max abs difference."""
    assert a.keys() == b.keys()
    assert any(k.startswith("optimizer/") for k in a) and any(k.startswith("model/") for k in a)
    return {k: (a[k].double() - b[k].double()).abs().max().item()
            for k in a if not torch.equal(a[k], b[k])}

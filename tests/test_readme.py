"""The README's quick start runs as written: killed while a snapshot is being written and run
again, it ends with the weights of a run that was never interrupted, bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def quickstart() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "the README's quick start has no python block"
    return found.group(1)


def run(cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    script = cwd / "train.py"
    script.write_text(quickstart(), encoding="utf-8")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("CIUIC_HOME", "CIUIC_FAILPOINTS", "CIUIC_ENDPOINT")}  # ./.ciuic
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env={**clean, **env},
                          capture_output=True, text=True, timeout=600)


def test_the_quick_start_resumes_bit_exactly_after_a_kill(tmp_path: Path) -> None:
    ref = run(tmp_path / "reference")
    assert ref.returncode == 0, ref.stderr
    assert "No snapshot of my-project/run-1 in .ciuic: starting from scratch" in ref.stderr

    # killed (SIGKILL) while the 4th snapshot (step 300) is being written: its chunks are
    # durable, its body is not, so step 200 is the latest committed snapshot
    job = tmp_path / "killed"
    killed = run(job, CIUIC_FAILPOINTS="body.put=kill@4")
    assert killed.returncode == -9, killed.stderr
    assert not (job / "model.pt").exists()
    resumed = run(job)
    assert resumed.returncode == 0, resumed.stderr
    assert "Found snapshot at step 200" in resumed.stderr
    assert "Resuming training at step 201" in resumed.stderr

    want = torch.load(tmp_path / "reference" / "model.pt")
    got = torch.load(job / "model.pt")
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name

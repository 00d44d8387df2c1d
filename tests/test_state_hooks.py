"""Models whose state dict is not simply their parameters (tests/helpers/hooked_models.py):
state-dict hooks that rename (a fused QKV projection, as torchtitan's), parametrizations,
tied weights and torch.compile, resumed exactly in one process and under FSDP2 on two ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.hooked_models import KINDS, resumed, uninterrupted

pytest.importorskip("safetensors.torch")
from safetensors.torch import load_file


def unequal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_one_process_resumes_exactly(kind: str, tmp_path: Path) -> None:
    got, want = resumed(kind, tmp_path), uninterrupted(kind)
    assert len(want) >= 4
    assert unequal(got, want) == []


def test_fsdp2_on_two_ranks_resumes_exactly(tmp_path: Path) -> None:
    from tests.framework_runs import free_port

    helper = Path(__file__).parent / "helpers" / "hooked_models.py"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(helper), str(tmp_path / "store"),
         str(tmp_path), *sorted(KINDS)],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    for kind in KINDS:
        saved = load_file(str(tmp_path / f"{kind}.safetensors"))
        got = {k.replace("resumed/", ""): v for k, v in saved.items() if "/resumed/" in k}
        want = {k.replace("reference/", ""): v for k, v in saved.items() if "/reference/" in k}
        assert any(k.startswith("rank1/") for k in got), kind
        assert unequal(got, want) == [], kind

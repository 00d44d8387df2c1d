"""megatron-core on a GPU: the scenario of tests/test_megatron.py on CUDA (NCCL, one GPU: TP 1,
bf16 parameters, the distributed optimizer with its fp32 master weights, Megatron's real CUDA RNG
tracker, which the CPU runs cannot have), SIGKILLed mid-epoch and run again, bit-exact.

Skipped without a GPU (CI has none) or without megatron-core; run on a lent GPU by
``scripts/device_check.sh``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.gpu import needs_cuda
from tests.test_megatron import differences, final, finished, killed, resumed_at, train

pytestmark = needs_cuda()

ARGS = ("--device", "cuda", "--tp", "1", "--dist-opt", "--every", "5")


def test_bf16_distributed_optimizer_killed_mid_epoch_ends_bit_exact(tmp_path: Path) -> None:
    finished(train(tmp_path / "a", *ARGS, ranks=1))
    ref = final(tmp_path / "a")
    killed(train(tmp_path / "b", *ARGS, "--kill-at", "17", ranks=1))
    again = finished(train(tmp_path / "b", *ARGS, ranks=1))
    assert resumed_at(again, "Megatron loop") == 15
    assert "ITERATION 18" in again.stdout
    resumed = final(tmp_path / "b")
    assert any(v.dtype == torch.bfloat16 for v in resumed.values())  # the model's parameters
    assert any(".param@" in k and v.dtype == torch.float32 for k, v in resumed.items())
    assert differences(ref, resumed) == {}  # type: ignore[arg-type]

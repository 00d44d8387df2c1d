"""In-process recovery on a GPU (#46): NCCL's communicators aborted under ``ciuic run
--nproc-per-node`` (``_abort_process_group``) and formed again in the survivors' processes; a
warm spare's first CUDA context and communicator. DDP on one GPU a rank (as many ranks as
GPUs, 2 at most; NCCL refuses two ranks on one GPU): a rank that raises in its optimizer
step, then one SIGKILLed in its forward (a warm spare takes its place), and the job ends with
every tensor equal to an uninterrupted run's on the same GPUs. Run by
scripts/device_check.sh; skipped without a GPU (failed where one must be: tests/helpers/gpu.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.gpu import needs_cuda
from tests.test_supervisor import CIUIC, assert_same, final

pytestmark = [needs_cuda(),
              pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="ciuic run needs Linux")]
HELPER = Path(__file__).parent / "helpers" / "ip_train.py"


def launch(out: Path, *args: str, run_args: tuple[str, ...] = ()
           ) -> subprocess.CompletedProcess[str]:
    ranks = min(2, torch.cuda.device_count())
    return subprocess.run(
        [*CIUIC, "run", "--nproc-per-node", str(ranks), *run_args, "--", sys.executable,
         str(HELPER), "--store", str(out / "store"), "--out", str(out / "out"), "--device",
         "cuda", "--steps", "30", *args],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})


def test_nccl_is_aborted_and_formed_again_in_process_and_a_spare_takes_a_gpu_rank(
        tmp_path: Path) -> None:
    ref = launch(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-4000:]
    last = min(2, torch.cuda.device_count()) - 1  # the last rank: rank 0 where one GPU
    run = launch(tmp_path / "run", "--fault", f"12:{last}:optimizer:raise", "--fault",
                 f"17:{last}:forward:kill", run_args=("--spares", "1"))
    assert run.returncode == 0, run.stderr[-5000:]
    assert "after 2 in-process recoveries" in run.stderr, run.stderr[-4000:]
    assert f"rank {last} goes to warm spare 0" in run.stderr, run.stderr[-4000:]
    assert_same(final(tmp_path / "run" / "out"), final(tmp_path / "ref" / "out"))

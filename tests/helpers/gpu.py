"""The CUDA tests' condition: skipped without a GPU, except where a GPU must be there.

``scripts/device_check.sh`` sets ``CIUIC_REQUIRE_CUDA=1`` on a machine where ``nvidia-smi``
finds a GPU: there a test that would skip for want of CUDA (torch built without it, a driver
that does not load) fails instead, at collection, saying why; a skip would let a GPU run pass
with none of its GPU tests run.
"""

from __future__ import annotations

import os

import pytest
import torch

REQUIRE = "CIUIC_REQUIRE_CUDA"


def needs_cuda() -> pytest.MarkDecorator:
    """The mark for a module of CUDA tests."""
    available = torch.cuda.is_available()
    if not available and os.environ.get(REQUIRE) == "1":
        raise RuntimeError(
            f"{REQUIRE}=1 (a GPU was found on this machine) but torch cannot use CUDA: torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}; install a CUDA build of "
            f"torch, or check the driver (nvidia-smi)")
    return pytest.mark.skipif(not available, reason="needs a CUDA device")

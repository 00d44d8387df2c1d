"""Staging: copy a snapshot's tensors into host buffers that are allocated once and reused.

This copy is the only part of an asynchronous snapshot that blocks training. Measured on the
development machine (../shared/docs/PERFORMANCE.md): copying 1 GiB into preallocated buffers
takes 0.04-0.07 s, while ``clone()`` into fresh memory takes 0.25-1.28 s, so buffers are kept
per tensor path and reused across snapshots; a buffer is reallocated only when its tensor's size
changes (for example when an optimizer creates its state after the first step).

CUDA tensors are copied into pinned buffers on a side stream (the training stream is not
blocked by the copy; the call returns once the copy has completed).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CiuicError
from ..tree import Leaf


class StagingBudgetExceeded(CiuicError, MemoryError):
    """The state does not fit in the staging budget; the snapshot is written synchronously."""


class StagingArea:
    """Reusable host buffers, one per tensor path.

    Args:
        budget_bytes: the most host memory the buffers may hold (None: the state's size).
    """

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def _buffer(self, path: str, nbytes: int, pin: bool) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.numel() != nbytes or (pin and not buf.is_pinned()):
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            self._buffers[path] = buf
        return buf

    def stage(self, leaves: list[Leaf]) -> int:
        """Copy every leaf into its buffer and point the leaf at the copy. Returns bytes copied.

        Raises :class:`StagingBudgetExceeded` (before copying anything) when the buffers would
        exceed the budget.
        """
        needed = {leaf.path: leaf.nbytes for leaf in leaves}
        for path in [p for p, b in self._buffers.items() if needed.get(p) != b.numel()]:
            del self._buffers[path]  # vanished or resized: free before allocating anew
        total = sum(needed.values())
        if self.budget_bytes is not None and total > self.budget_bytes:
            raise StagingBudgetExceeded(
                f"the state needs {total} bytes of staging memory, over the budget of "
                f"{self.budget_bytes}; the snapshot is written synchronously instead"
            )
        cuda = any(isinstance(leaf.value, torch.Tensor) and leaf.value.is_cuda for leaf in leaves)
        if cuda and self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        copied = 0
        for leaf in leaves:
            buf = self._buffer(leaf.path, needed[leaf.path], pin=cuda)
            leaf.value = self._copy(leaf.value, buf)
            copied += buf.numel()
        if cuda:
            assert self._stream is not None
            self._stream.synchronize()
        return copied

    def _copy(self, value: torch.Tensor | np.ndarray,
              buf: torch.Tensor) -> torch.Tensor | np.ndarray:
        if isinstance(value, np.ndarray):
            dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
            dst = buf.numpy().view(dtype).reshape(value.shape)
            np.copyto(dst, value)
            return dst
        src = value.detach()
        dst_t = buf.view(src.dtype).view(src.shape)
        if src.is_cuda:
            assert self._stream is not None
            self._stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(self._stream):
                dst_t.copy_(src, non_blocking=True)
        else:
            dst_t.copy_(src.resolve_conj().resolve_neg())
        return dst_t

    def release(self) -> None:
        """Free every buffer."""
        self._buffers.clear()

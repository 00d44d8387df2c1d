"""Staging: copy a snapshot's tensors into host buffers that are allocated once and reused.

This copy is the only part of an asynchronous snapshot that blocks training. Measured on the
development machine (../shared/docs/PERFORMANCE.md): copying 1 GiB into preallocated buffers
takes 0.04-0.07 s, while ``clone()`` into fresh memory takes 0.25-1.28 s, so buffers are kept
per tensor path and reused across snapshots; a buffer is reallocated only when its tensor's size
changes (for example when an optimizer creates its state after the first step).

CUDA tensors are copied into pinned buffers on a side stream (the training stream is not
blocked by the copy; the call returns once the copy has completed).

Overlapped mode (:meth:`StagingArea.stage_overlapped`) returns before the copy of the "guarded"
tensors (parameters and optimizer state: what only the optimizer changes) has finished: on CUDA
the copies are queued on the side stream and an event marks their end; on the CPU a thread copies
them. The caller waits on the returned :class:`PendingCopy` before anything may change those
tensors (an optimizer step pre-hook) and before the writer reads the buffers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from ..errors import CiuicError
from ..faults import failpoint
from ..tree import Leaf


class StagingBudgetExceeded(CiuicError, MemoryError):
    """The state does not fit in the staging budget; the snapshot is written synchronously."""


def _view(value: torch.Tensor | np.ndarray, buf: torch.Tensor) -> torch.Tensor | np.ndarray:
    """``buf`` seen as an array or tensor shaped like ``value`` (little-endian), without copying."""
    if isinstance(value, np.ndarray):
        dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
        return buf.numpy().view(dtype).reshape(value.shape)
    return buf.view(value.dtype).view(value.shape)


class PendingCopy:
    """Copies still running after :meth:`StagingArea.stage_overlapped` returned."""

    def __init__(self, event: torch.cuda.Event | None = None,
                 thread: threading.Thread | None = None) -> None:
        self._event = event
        self._thread = thread
        self.error: BaseException | None = None
        self._done = False

    def wait(self) -> None:
        """Block until every copy has landed; re-raise a copy's failure."""
        if not self._done:
            if self._event is not None:
                self._event.synchronize()
            if self._thread is not None:
                self._thread.join()
            self._done = True
        if self.error is not None:
            raise self.error


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

    def lend(self, path: str, nbytes: int, pin: bool) -> torch.Tensor | None:
        """The buffer for ``path`` (allocated now if needed) for a restore to read into, or None
        when it would not fit the budget.

        A restore reads the model's tensors into the buffers the next snapshot stages into, so
        the first snapshot after a resume allocates nothing (pinned, for a model on a GPU: the
        copy to the device then runs at pinned speed). The caller must copy out of the buffer
        before the next snapshot, as ``load_state_dict`` does.
        """
        buf = self._buffers.get(path)
        grows = nbytes - (buf.numel() if buf is not None else 0)
        if self.budget_bytes is not None and self.allocated_bytes + grows > self.budget_bytes:
            return None
        return self._buffer(path, nbytes, pin)

    def stage(self, leaves: list[Leaf]) -> int:
        """Copy every leaf into its buffer and point the leaf at the copy. Returns bytes copied.

        Raises :class:`StagingBudgetExceeded` (before copying anything) when the buffers would
        exceed the budget.
        """
        self._prepare(leaves)
        cuda = self._uses_cuda(leaves)
        copied = 0
        for leaf in leaves:
            copied += self._stage_leaf(leaf, cuda)
        if cuda:
            assert self._stream is not None
            self._stream.synchronize()
        return copied

    def stage_overlapped(self, leaves: list[Leaf],
                         guarded: Callable[[Leaf], bool]) -> PendingCopy:
        """Stage the leaves for which ``guarded`` is False now, the others in the background.

        The leaves point at their buffers on return, but the guarded ones hold their values
        only once the returned :class:`PendingCopy` has been waited for.
        """
        self._prepare(leaves)
        cuda = self._uses_cuda(leaves)
        later = [leaf for leaf in leaves if guarded(leaf)]
        for leaf in leaves:
            if not guarded(leaf):
                self._stage_leaf(leaf, cuda)
        if cuda:
            assert self._stream is not None
            for leaf in later:
                self._stage_leaf(leaf, cuda)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
            return PendingCopy(event=event)
        # CPU: point the leaves at their buffers now, copy on a thread.
        sources = [(leaf, leaf.value) for leaf in later]
        for leaf in later:
            leaf.value = _view(leaf.value, self._buffer(leaf.path, leaf.nbytes, pin=False))
        pending = PendingCopy()

        def copy() -> None:
            try:
                failpoint("stage.copy")
                for leaf, value in sources:
                    self._copy(value, self._buffers[leaf.path])
            except BaseException as e:  # re-raised by wait()
                pending.error = e

        thread = threading.Thread(target=copy, name="ciuic-stage", daemon=True)
        pending._thread = thread
        thread.start()
        return pending

    def _uses_cuda(self, leaves: list[Leaf]) -> bool:
        cuda = any(isinstance(leaf.value, torch.Tensor) and leaf.value.is_cuda for leaf in leaves)
        if cuda and self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        return cuda

    def _stage_leaf(self, leaf: Leaf, cuda: bool) -> int:
        buf = self._buffer(leaf.path, leaf.nbytes, pin=cuda)
        leaf.value = self._copy(leaf.value, buf)
        return buf.numel()

    def _prepare(self, leaves: list[Leaf]) -> None:
        """Drop buffers of vanished or resized tensors; enforce the budget."""
        needed = {leaf.path: leaf.nbytes for leaf in leaves}
        for path in [p for p, b in self._buffers.items() if needed.get(p) != b.numel()]:
            del self._buffers[path]  # vanished or resized: free before allocating anew
        total = sum(needed.values())
        if self.budget_bytes is not None and total > self.budget_bytes:
            raise StagingBudgetExceeded(
                f"the state needs {total} bytes of staging memory, over the budget of "
                f"{self.budget_bytes}; the snapshot is written synchronously instead"
            )

    def _copy(self, value: torch.Tensor | np.ndarray,
              buf: torch.Tensor) -> torch.Tensor | np.ndarray:
        dst = _view(value, buf)
        if isinstance(dst, np.ndarray):
            np.copyto(dst, value)
            return dst
        assert isinstance(value, torch.Tensor)
        src = value.detach()
        dst_t = dst
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

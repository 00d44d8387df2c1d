"""Staging: copy a snapshot's tensors into host buffers that are allocated once and reused.

This copy is the only part of an asynchronous snapshot that blocks training. Measured on the
development machine (../shared/docs/PERFORMANCE.md): copying 1 GiB into preallocated buffers
takes 0.04-0.07 s, while ``clone()`` into fresh memory takes 0.25-1.28 s, so buffers are kept
per tensor path and reused across snapshots; a buffer is reallocated only when its tensor's size
changes (for example when an optimizer creates its state after the first step).

CUDA tensors are copied into pinned buffers on a side stream (the training stream is not
blocked by the copy; the call returns once the copy has completed). Pinned buffers are plain host
memory of the exact size, page-locked with ``cudaHostRegister`` (as DCP's own stager does):
PyTorch's pinned allocator rounds every block up to a power of two, which for the H200 reference
state of PERFORMANCE.md (5.9 GB in 60 tensors) would hold 9.7 GB, 1.66x the state.

Allocating is slower than copying (5.6 GB of pinned memory: 2.9 s on the H200, against 0.1 s for
the copy), so :meth:`StagingArea.reserve` allocates a state's buffers on a background thread
before its first snapshot is due; the first snapshot then only copies.

Overlapped mode (:meth:`StagingArea.stage_overlapped`) returns before the copy of the "guarded"
tensors (parameters and optimizer state: what only the optimizer changes) has finished: on CUDA
the copies are queued on the side stream and an event marks their end; on the CPU a thread copies
them. The caller waits on the returned :class:`PendingCopy` before anything may change those
tensors (an optimizer step pre-hook) and before the writer reads the buffers.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import numpy as np
import torch

from ..errors import CiuicError
from ..faults import failpoint
from ..tree import Leaf

log = logging.getLogger("ciuic")


class StagingBudgetExceeded(CiuicError, MemoryError):
    """The state does not fit in the staging budget; the snapshot is written synchronously."""


def _view(value: torch.Tensor | np.ndarray, buf: torch.Tensor) -> torch.Tensor | np.ndarray:
    """``buf`` seen as an array or tensor shaped like ``value`` (little-endian), without copying."""
    if isinstance(value, np.ndarray):
        dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
        return buf.numpy().view(dtype).reshape(value.shape)
    return buf.view(value.dtype).view(value.shape)


def _unpin(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]


_register_failed = False


def allocate_host(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory (uninitialized), page-locked when ``pin``.

    Pinned memory is registered with ``cudaHostRegister`` at its exact size and unregistered
    when the tensor is freed; where registering fails, PyTorch's pinned allocator is used (it
    rounds up to a power of two), with one warning.
    """
    global _register_failed
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8)
    if not _register_failed and nbytes > 0:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        ptr = buf.data_ptr()
        try:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            err = int(cudart.cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
        except Exception as e:  # no such binding in this torch build
            err, why = -1, f"{type(e).__name__}: {e}"
        else:
            why = f"cudaError {err}"
        if err == 0:
            weakref.finalize(buf, _unpin, ptr)
            return buf
        _register_failed = True
        log.warning("could not page-lock staging memory with cudaHostRegister (%s); using "
                    "PyTorch's pinned allocator, which rounds each buffer up to a power of two "
                    "(more host memory)", why)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


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
        self._pinned: set[str] = set()
        self._stream: torch.cuda.Stream | None = None
        self._reserving: threading.Thread | None = None
        #: Seconds the last :meth:`reserve` took on its thread (allocating, page-locking).
        self.reserve_s = 0.0

    @property
    def allocated_bytes(self) -> int:
        self.join()
        return sum(b.numel() for b in self._buffers.values())

    def _buffer(self, path: str, nbytes: int, pin: bool) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.numel() != nbytes or (pin and path not in self._pinned):
            self._buffers.pop(path, None)  # free the old one before allocating anew
            buf = allocate_host(nbytes, pin)
            self._buffers[path] = buf
            if pin:
                self._pinned.add(path)
            else:
                self._pinned.discard(path)
        return buf

    def reserve(self, sizes: Iterable[tuple[str, int]], pin: bool) -> bool:
        """Allocate buffers for tensors of these (path, bytes) on a background thread, so that
        the first snapshot only copies. Returns False (allocating nothing) when they would not
        fit the budget. Every other method waits for the thread first."""
        wanted = dict(sizes)
        self.join()
        if self.budget_bytes is not None and sum(wanted.values()) > self.budget_bytes:
            return False

        def allocate() -> None:
            t0 = time.perf_counter()
            try:
                for path, nbytes in wanted.items():
                    old = self._buffers.get(path)
                    buf = self._buffer(path, nbytes, pin)
                    if buf is not old and not pin:  # never touch a buffer already in use
                        buf.zero_()  # fault the pages in now, not during the first copy
            except Exception as e:  # the first snapshot allocates what is missing
                log.warning("could not allocate staging buffers ahead of the first snapshot "
                            "(%s); it will allocate them itself", e)
            self.reserve_s = time.perf_counter() - t0

        self._reserving = threading.Thread(target=allocate, name="ciuic-reserve", daemon=True)
        self._reserving.start()
        return True

    def join(self) -> None:
        """Wait for a :meth:`reserve` in progress."""
        thread = self._reserving
        if thread is not None:
            thread.join()
            self._reserving = None

    def lend(self, path: str, nbytes: int, pin: bool) -> torch.Tensor | None:
        """The buffer for ``path`` (allocated now if needed) for a restore to read into, or None
        when it would not fit the budget.

        A restore reads the model's tensors into the buffers the next snapshot stages into, so
        the first snapshot after a resume allocates nothing (pinned, for a model on a GPU: the
        copy to the device then runs at pinned speed). The caller must copy out of the buffer
        before the next snapshot, as ``load_state_dict`` does.
        """
        self.join()
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
        self.join()
        needed = {leaf.path: leaf.nbytes for leaf in leaves}
        for path in [p for p, b in self._buffers.items() if needed.get(p) != b.numel()]:
            del self._buffers[path]  # vanished or resized: free before allocating anew
            self._pinned.discard(path)
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
            # a temporary source (a DTensor's local view, say) freed on the training stream
            # must not be reused by it before the side stream has read it
            src.record_stream(self._stream)
        else:
            dst_t.copy_(src.resolve_conj().resolve_neg())
        return dst_t

    def release(self) -> None:
        """Free every buffer."""
        self.join()
        self._buffers.clear()
        self._pinned.clear()

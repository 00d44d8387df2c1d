"""Staging: copy a snapshot's tensors into host buffers that are allocated once and reused.

This copy is the only part of an asynchronous snapshot that blocks training. Measured on the
development machine (docs/benchmarks.md): copying 1 GiB into preallocated buffers
takes 0.04-0.07 s, while ``clone()`` into fresh memory takes 0.25-1.28 s, so buffers are kept
per tensor path and reused across snapshots; a buffer is reallocated only when its tensor's size
changes (for example when an optimizer creates its state after the first step).

CUDA tensors are copied into pinned buffers on a side stream (the training stream is not
blocked by the copy; the call returns once the copy has completed). Pinned buffers are plain host
memory of the exact size, page-locked with ``cudaHostRegister`` (as DCP's own stager does):
PyTorch's pinned allocator rounds every block up to a power of two, which for the H200 reference
state of docs/benchmarks.md (5.9 GB in 60 tensors) would hold 9.7 GB, 1.66x the state.

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

import contextlib
import logging
import mmap
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import numpy as np
import torch

from ciuic import knobs
from ciuic.engine import unchanged, written
from ciuic.engine.own_thread import OwnThread
from ciuic.errors import StagingBudgetExceeded
from ciuic.faults import failpoint
from ciuic.format import chunks as ck
from ciuic.format.tree import Leaf
from ciuic.threads import lower_priority

log = logging.getLogger("ciuic")


def _view(value: torch.Tensor | np.ndarray, buf: torch.Tensor) -> torch.Tensor | np.ndarray:
    """``buf`` seen as an array or tensor shaped like ``value`` (little-endian), without copying."""
    if isinstance(value, np.ndarray):
        dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
        return buf.numpy().view(dtype).reshape(value.shape)
    return buf.view(value.dtype).view(value.shape)


def _inside(value: torch.Tensor | np.ndarray, buf: torch.Tensor) -> bool:
    """Whether ``value``'s memory starts inside ``buf`` (a view of it)."""
    if isinstance(value, np.ndarray):
        ptr = int(value.__array_interface__["data"][0])
    elif value.device.type == "cpu" and value.layout == torch.strided:
        ptr = value.data_ptr()
    else:
        return False
    start = buf.data_ptr()
    return start <= ptr < start + buf.numel()


def _range_copier(value: torch.Tensor | np.ndarray,
                  buf: torch.Tensor) -> Callable[[int, int], None] | None:
    """A copy of a byte range of ``value`` (contiguous, in host memory) into ``buf`` by torch:
    vectorized, on all of torch's threads (NumPy arrays: None, ``memmove``)."""
    if isinstance(value, np.ndarray):
        return None
    flat = value.detach().reshape(-1)
    size = flat.element_size()

    def copy(off: int, n: int) -> None:
        # in elements: 5 % faster than bytes here (not bool: a copy makes each byte 0 or 1)
        if off % size == 0 and n % size == 0 and flat.dtype != torch.bool:
            buf.view(flat.dtype)[off // size:(off + n) // size].copy_(
                flat[off // size:(off + n) // size])
        else:
            buf[off:off + n].copy_(flat.view(torch.uint8)[off:off + n])

    return copy


_PAGE = mmap.PAGESIZE
#: Where a staging buffer starts, past a page boundary: a raw chunk's header bytes.
SKEW = ck.HEADER_BYTES
_register_failed = False
#: Where every CUDA runtime call of this module runs. A failed call leaves its error as the
#: calling thread's "last error", where PyTorch's next kernel-launch check would find it and
#: raise it against an unrelated kernel of the training thread; on this thread it is harmless.
_pin_thread = OwnThread("ciuic-pin")


def _register(ptr: int, size: int, device: int) -> int:
    torch.cuda.set_device(device)  # its context, not device 0's (this thread has no other work)
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    return int(cudart.cudaHostRegister(ptr, size, 1))  # 1: cudaHostRegisterPortable


def _unregister(ptr: int, device: int) -> None:
    torch.cuda.set_device(device)
    torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]


def _unpin(ptr: int, device: int) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
        _pin_thread.run(_unregister, ptr, device)


def allocate_host(nbytes: int, pin: int | None = None) -> torch.Tensor:
    """``nbytes`` of host memory (uninitialized), page-locked for CUDA device ``pin`` unless
    None.

    The memory starts :data:`SKEW` bytes past a page boundary: a chunk of it, behind its
    16-byte header, then lies on page boundaries, and the local store writes it with direct I/O
    straight from here (store/direct.py). Each buffer is an allocation of its own, so two
    buffers never share a page.

    Pinned memory is registered with ``cudaHostRegister`` at its exact size (whole pages:
    registering a page twice is refused) and unregistered when the last view of it is freed
    (numpy runs the finalizer before it frees the memory); where registering fails, PyTorch's
    pinned allocator is used (it rounds up to a power of two, and its buffers are not skewed),
    with one warning.
    """
    global _register_failed
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    if pin is not None and _register_failed:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    raw = np.empty(nbytes + 2 * _PAGE + SKEW, dtype=np.uint8)
    page = -raw.ctypes.data % _PAGE  # the first page boundary inside ``raw``
    start = page + SKEW
    buf = torch.from_numpy(raw[start:start + nbytes])
    if pin is None:
        return buf
    ptr = raw.ctypes.data + page
    span = -(-(SKEW + nbytes) // _PAGE) * _PAGE
    try:
        err = _pin_thread.run(_register, ptr, span, pin)
        why = f"cudaError {err}"
    except Exception as e:  # no such binding in this torch build
        err, why = -1, f"{type(e).__name__}: {e}"
    if err == 0:
        weakref.finalize(raw, _unpin, ptr, pin)
        return buf
    _register_failed = True
    log.warning("could not page-lock staging memory with cudaHostRegister (%s); using "
                "PyTorch's pinned allocator, which rounds each buffer up to a power of two "
                "(more host memory)", why)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _pin_existing(buf: torch.Tensor, device: int) -> bool:
    """Page-lock ``buf`` (page-aligned host memory, e.g. shared) for CUDA ``device``; False
    where that fails (the caller allocates ordinary pinned memory instead)."""
    ptr, span = buf.data_ptr(), -(-buf.numel() // _PAGE) * _PAGE
    try:
        err = _pin_thread.run(_register, ptr, span, device)
    except Exception as e:
        log.debug("could not page-lock a shared staging buffer: %s", e)
        return False
    if err != 0:
        log.debug("could not page-lock a shared staging buffer: cudaError %s", err)
        return False
    weakref.finalize(buf, _unpin, ptr, device)
    return True


class PendingCopy:
    """Copies still running after :meth:`StagingArea.stage_overlapped` returned."""

    def __init__(self, events: list[torch.cuda.Event] | None = None,
                 thread: threading.Thread | None = None) -> None:
        self._events = events or []
        self._thread = thread
        self.error: BaseException | None = None
        self._done = False

    def wait(self) -> None:
        """Block until every copy has landed; re-raise a copy's failure."""
        if not self._done:
            for event in self._events:
                event.synchronize()
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

    def __init__(self, budget_bytes: int | None = None,
                 allocator: Callable[[str, int], torch.Tensor | None] | None = None) -> None:
        self.budget_bytes = budget_bytes
        #: where host buffers come from first (shared memory under ``ciuic run``); None from
        #: it, or no allocator: ordinary memory
        self.allocator = allocator
        self._buffers: dict[str, torch.Tensor] = {}
        self._pinned: set[str] = set()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # one per source device
        self._reserving: threading.Thread | None = None
        #: the leaf last staged into each buffer: its ``digests`` (filled by the writer) are
        #: those of the buffer's bytes, which the next snapshot compares the live tensor with
        self._staged: dict[str, Leaf] = {}
        #: Seconds the last :meth:`reserve` took on its thread (allocating, page-locking).
        self.reserve_s = 0.0
        #: host tensors whose pages the kernel watches for writes (engine/written.py)
        self.watched = written.Tracker()

    @property
    def allocated_bytes(self) -> int:
        self.join()
        return sum(b.numel() for b in self._buffers.values())

    def _buffer(self, path: str, nbytes: int, pin: int | None) -> torch.Tensor:
        """The buffer for ``path``: page-locked for CUDA device ``pin`` unless None."""
        buf = self._buffers.get(path)
        if buf is None or buf.numel() != nbytes or (pin is not None and path not in self._pinned):
            self._buffers.pop(path, None)  # free the old one before allocating anew
            self._staged.pop(path, None)
            buf = self._allocate(path, nbytes, pin)
            self._buffers[path] = buf
            if pin is not None:
                self._pinned.add(path)
            else:
                self._pinned.discard(path)
        return buf

    def _allocate(self, path: str, nbytes: int, pin: int | None) -> torch.Tensor:
        if self.allocator is not None:
            buf = self.allocator(path, nbytes)
            if buf is not None and (pin is None or _pin_existing(buf, pin)):
                return buf
        return allocate_host(nbytes, pin)

    def adopt(self, buffers: dict[str, torch.Tensor]) -> None:
        """Take these host buffers (path -> flat uint8, unpinned) as the staging buffers of
        their paths: the host copy a previous process left (``ciuic run``)."""
        self.join()
        for path, buf in buffers.items():
            self._buffers[path] = buf
            self._staged.pop(path, None)
            self._pinned.discard(path)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer, by the path of the tensor it stages."""
        self.join()
        return dict(self._buffers)

    def held_chunks(self) -> dict[str, memoryview]:
        """The chunks the buffers hold as the last write named them, by digest: a restore in
        this process (a rollback) takes them from here, checking each against its digest, and
        reads only the others from the store. A buffer being copied into, or whose copy was
        cut short, has no digests and offers nothing."""
        self.join()
        out: dict[str, memoryview] = {}
        for path, leaf in self._staged.items():
            buf = self._buffers.get(path)
            if leaf.digests is None or buf is None or not buf.numel():
                continue
            chunk_bytes, digests = leaf.digests
            split = ck.split(buf.numel(), chunk_bytes)
            if len(split) != len(digests):
                continue
            view = buf.numpy().data.cast("B")
            for d, (off, n) in zip(digests, split, strict=True):
                if d is not None:
                    out.setdefault(d, view[off:off + n])
        return out

    def reserve(self, sizes: Iterable[tuple[str, int]], pin: int | None) -> bool:
        """Allocate buffers for tensors of these (path, bytes) on a background thread, so that
        the first snapshot only copies. Returns False (allocating nothing) when they would not
        fit the budget. Every other method waits for the thread first."""
        wanted = dict(sizes)
        self.join()
        if self.budget_bytes is not None and sum(wanted.values()) > self.budget_bytes:
            return False

        if pin is not None:  # the pin thread, made by this thread: at its priority, not lowered
            _pin_thread.run(lambda: None)

        def allocate() -> None:
            lower_priority()  # training runs its first steps meanwhile
            t0 = time.perf_counter()
            try:
                for path, nbytes in wanted.items():
                    old = self._buffers.get(path)
                    buf = self._buffer(path, nbytes, pin)
                    if buf is not old and pin is None:  # never touch a buffer in use
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

    def lend(self, path: str, nbytes: int, pin: int | None) -> torch.Tensor | None:
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
        self._staged.pop(path, None)  # the restore overwrites what the digests described
        return self._buffer(path, nbytes, pin)

    def stage(self, leaves: list[Leaf]) -> int:
        """Copy every leaf into its buffer and point the leaf at the copy. Returns bytes copied.

        Raises :class:`StagingBudgetExceeded` (before copying anything) when the buffers would
        exceed the budget.
        """
        self._prepare(leaves)
        self.watched.new_snapshot()
        pin = self.pin_device(leaves)
        copied = 0
        for leaf in leaves:
            copied += self._stage_leaf(leaf, pin)
        for stream in self._streams.values():
            stream.synchronize()
        return copied

    def stage_overlapped(self, leaves: list[Leaf],
                         guarded: Callable[[Leaf], bool]) -> PendingCopy:
        """Stage the leaves for which ``guarded`` is False now, the others in the background.

        The leaves point at their buffers on return, but the guarded ones hold their values
        only once the returned :class:`PendingCopy` has been waited for.
        """
        self._prepare(leaves)
        self.watched.new_snapshot()
        pin = self.pin_device(leaves)
        later = [leaf for leaf in leaves if guarded(leaf)]
        for leaf in leaves:
            if not guarded(leaf):
                self._stage_leaf(leaf, pin)
        if pin is not None:
            for leaf in later:
                self._stage_leaf(leaf, pin)
            events = []
            for stream in self._streams.values():
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                events.append(event)
            return PendingCopy(events=events)
        # CPU: point the leaves at their buffers now, copy on a thread.
        sources = []
        for leaf in later:
            buf = self._own_buffer(leaf, pin=None)
            sources.append((leaf.value, buf, leaf, self._known(leaf)))
            leaf.value = _view(leaf.value, buf)
            leaf.digests = None  # until the thread has compared
            self._staged[leaf.path] = leaf
        pending = PendingCopy()

        def copy() -> None:
            try:
                failpoint("stage.copy")
                for value, buf, leaf, known in sources:
                    leaf.digests = self._copy(value, buf, known, leaf.path)[1]
            except BaseException as e:  # re-raised by wait()
                pending.error = e

        thread = threading.Thread(target=copy, name="ciuic-stage", daemon=True)
        pending._thread = thread
        thread.start()
        return pending

    @staticmethod
    def pin_device(leaves: list[Leaf]) -> int | None:
        """The CUDA device to page-lock buffers for (the first CUDA leaf's), or None."""
        for leaf in leaves:
            if isinstance(leaf.value, torch.Tensor) and leaf.value.is_cuda:
                return leaf.value.device.index or 0
        return None

    def _own_buffer(self, leaf: Leaf, pin: int | None) -> torch.Tensor:
        """The buffer for ``leaf``, never the memory of its live value: a restore lends the
        buffers to the model, and a module may keep the tensor it is given
        (``set_extra_state``, a custom ``load_state_dict``); that buffer is then left to it."""
        buf = self._buffer(leaf.path, leaf.nbytes, pin)
        if buf.numel() and _inside(leaf.value, buf):
            del self._buffers[leaf.path]
            self._staged.pop(leaf.path, None)
            buf = self._buffer(leaf.path, leaf.nbytes, pin)
        return buf

    def _stage_leaf(self, leaf: Leaf, pin: int | None) -> int:
        buf = self._own_buffer(leaf, pin)
        known = self._known(leaf)
        # forgotten before the copy starts: a copy interrupted part way (an exception, a
        # second Ctrl-C) leaves bytes that no digest describes
        self._staged.pop(leaf.path, None)
        leaf.value, leaf.digests = self._copy(leaf.value, buf, known, leaf.path)
        self._staged[leaf.path] = leaf
        return buf.numel()

    def _known(self, leaf: Leaf) -> tuple[int, list[str | None]] | None:
        """The digests of the chunks of ``leaf``'s buffer as the last snapshot wrote them."""
        prev = self._staged.get(leaf.path)
        if prev is None or prev.digests is None or prev.digests[0] != knobs.get().chunk_bytes:
            return None
        return prev.digests

    def _prepare(self, leaves: list[Leaf]) -> None:
        """Drop buffers of vanished or resized tensors; enforce the budget."""
        self.join()
        needed = {leaf.path: leaf.nbytes for leaf in leaves}
        for path in [p for p, b in self._buffers.items() if needed.get(p) != b.numel()]:
            del self._buffers[path]  # vanished or resized: free before allocating anew
            self._pinned.discard(path)
            self._staged.pop(path, None)
        total = sum(needed.values())
        if self.budget_bytes is not None and total > self.budget_bytes:
            raise StagingBudgetExceeded(
                f"the state needs {total} bytes of staging memory, over the budget of "
                f"{self.budget_bytes}; the snapshot is written synchronously instead"
            )

    def _copy(self, value: torch.Tensor | np.ndarray, buf: torch.Tensor,
              known: tuple[int, list[str | None]] | None, path: str
              ) -> tuple[torch.Tensor | np.ndarray, tuple[int, list[str | None]] | None]:
        """Copy ``value`` into ``buf``; returns the view of ``buf`` shaped like ``value`` and
        the digests of the chunks that were equal already (``known``: those of ``buf``)."""
        dst = _view(value, buf)
        ptr = unchanged.host_pointer(value)
        if ptr is not None and unchanged.available():  # host memory: compare, then copy
            chunk_bytes, digests = known if known is not None else (knobs.get().chunk_bytes, None)
            large = buf.numel() >= unchanged.LARGE_COPY_BYTES  # else every copy is memmove
            # the pages written since the buffer was made equal to them (where watched)
            entry, same = self.watched.before(path, value, ptr, buf.numel(),
                                              ck.split(buf.numel(), chunk_bytes))
            kept = unchanged.copy_changed(ptr, buf.data_ptr(), buf.numel(), chunk_bytes,
                                          digests, keep=(value, buf),
                                          copy_large=_range_copier(value, buf) if large else None,
                                          same=same)
            self.watched.after(path, entry, kept)
            return dst, None if kept is None else (chunk_bytes, kept)
        if isinstance(dst, np.ndarray):
            np.copyto(dst, value)
            return dst, None
        assert isinstance(value, torch.Tensor)
        src = value.detach()
        dst_t = dst
        if src.is_cuda:
            stream = self._streams.get(src.device)
            if stream is None:  # on the source's device: a copy runs on its device's stream
                stream = torch.cuda.Stream(device=src.device)  # type: ignore[no-untyped-call]
                self._streams[src.device] = stream
            stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(stream):
                dst_t.copy_(src, non_blocking=True)
            # a temporary source (a DTensor's local view, say) freed on the training stream
            # must not be reused by it before the side stream has read it
            src.record_stream(stream)
        else:
            dst_t.copy_(src.resolve_conj().resolve_neg())
        return dst_t, None

    def release(self) -> None:
        """Free every buffer."""
        self.join()
        self._staged.clear()
        self._buffers.clear()
        self._pinned.clear()
        self.watched.clear()

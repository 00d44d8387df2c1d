"""Where a restore's leaf bytes come from and land, besides fresh memory: the store (each chunk
read and verified against its name), the host-memory copy ``ciuic run`` keeps of the latest
snapshot (:class:`Resident`: each chunk checked against its digest before use), and buffers lent
for the reads (:data:`BufferFor`; :func:`lend_staging`: the staging buffers the next snapshot
copies into).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ciuic.chain.read import read_chunk, take_chunk
from ciuic.chain.repo import Repository

if TYPE_CHECKING:  # types only: the readers (ciuic restore --to, diff) need neither at run time
    from ciuic.engine import StagingArea
    from ciuic.supervisor.hostcopy import HostTier

#: ``buffer_for(path, nbytes)``: a flat uint8 buffer to read a leaf into, or None (the reader
#: allocates one)
BufferFor = Callable[[str, int], "torch.Tensor | None"]


class Resident:
    """A snapshot's leaf bytes already in host memory (``ciuic run``'s host-memory tier): a
    restore takes each chunk from here after checking it against its digest, and reads a chunk
    that differs from the store."""

    def __init__(self, snapshot: str, buffers: dict[str, torch.Tensor],
                 name_key: bytes | None) -> None:
        self.snapshot = snapshot
        self.buffers = buffers
        self.name_key = name_key
        self.from_memory = 0  # bytes
        self.from_store = 0
        self._lock = threading.Lock()

    def get(self, path: str, nbytes: int) -> torch.Tensor | None:
        buf = self.buffers.get(path)
        return buf if buf is not None and buf.numel() == nbytes else None

    def count(self, n: int, memory: bool) -> None:
        with self._lock:
            if memory:
                self.from_memory += n
            else:
                self.from_store += n

    def take(self, repo: Repository, d: str, n: int, dest: memoryview,
             src: memoryview | None) -> None:
        """Chunk ``d`` into ``dest``: from ``src`` (this memory) when it matches its digest,
        else read from the store."""
        self.count(n, take_chunk(repo, d, n, dest, src, self.name_key))


def read_from(repo: Repository, resident: Resident | None, d: str, n: int,
              dest: memoryview) -> None:
    """Chunk ``d`` read from the store into ``dest`` (counted as such by ``resident``)."""
    read_chunk(repo, d, n, dest)
    if resident is not None:
        resident.count(n, memory=False)


def host_copy(tier: HostTier | None, name_key: bytes | None) -> Resident | None:
    """The snapshot a previous process of this job left in host memory (``ciuic run``), as the
    buffers this process adopted, or None."""
    if tier is None or tier.snapshot is None or not tier.adopted:
        return None
    return Resident(tier.snapshot, dict(tier.adopted), name_key)


def lend_staging(staging: StagingArea, model: Any) -> BufferFor | None:
    """Lend the staging buffers to the model's tensors for a restore: ``load_state_dict``
    copies out of them, and the first snapshot after the resume stages into them without
    allocating. Only the model's: an optimizer's ``load_state_dict`` keeps the tensors it is
    given."""
    if model is None:
        return None
    fn = getattr(model, "state_dict", None)
    live = fn() if callable(fn) else None
    values = live.values() if isinstance(live, dict) else ()
    pin = next((t.device.index or 0 for t in values
                if isinstance(t, torch.Tensor) and t.is_cuda), None)

    def buffer_for(path: str, nbytes: int) -> torch.Tensor | None:
        if not path.startswith("model/"):
            return None
        return staging.lend(path, nbytes, pin)

    return buffer_for

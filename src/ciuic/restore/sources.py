"""Where a restore's leaf bytes come from and land, besides fresh memory: the store (each chunk
read and verified against its name), the host memory ``ciuic run`` keeps of the latest
snapshots (:class:`Resident`: this rank's staged leaves and the node's published chunks, each
chunk checked against its digest before use), and buffers lent for the reads
(:data:`BufferFor`; :func:`lend_staging`: the staging buffers the next snapshot copies into).
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
    from ciuic.supervisor.peers import PeerReader

#: ``buffer_for(path, nbytes)``: a flat uint8 buffer to read a leaf into, or None (the reader
#: allocates one)
BufferFor = Callable[[str, int], "torch.Tensor | None"]


class Resident:
    """A snapshot's bytes already in host memory (``ciuic run``'s host-memory tier): the
    leaves a previous process of this rank staged (by path: ``buffers``, only for the snapshot
    they hold) and every chunk the node's ranks published (by digest: ``chunks``, for any
    snapshot that holds them). A restore takes each chunk from here after checking it against
    its digest, and reads a chunk that differs, or is not here, from the store; the bytes from
    each source are counted."""

    def __init__(self, snapshot: str | None, buffers: dict[str, torch.Tensor],
                 name_key: bytes | None, chunks: dict[str, memoryview] | None = None,
                 peers: PeerReader | None = None) -> None:
        self.snapshot = snapshot
        self.buffers = buffers
        self.chunks = chunks or {}
        #: the other nodes' memory (a job of several nodes under ``ciuic run``)
        self.peers = peers
        self.name_key = name_key
        self.from_memory = 0  # bytes
        self.from_peers = 0
        self.from_store = 0
        self._lock = threading.Lock()

    def serving(self, snapshot: str) -> Resident | None:
        """What serves a restore of ``snapshot`` (fresh counts): the leaves by path only when
        they hold it; the chunks by digest whatever it is. None where memory holds nothing."""
        buffers = self.buffers if snapshot == self.snapshot else {}
        if not buffers and not self.chunks and self.peers is None:
            return None
        return Resident(snapshot, buffers, self.name_key, self.chunks, self.peers)

    def held(self) -> int:
        """Bytes of the state this memory holds (the larger of the two views of it)."""
        return max(sum(b.numel() for b in self.buffers.values()),
                   sum(len(v) for v in self.chunks.values()))

    def get(self, path: str, nbytes: int) -> torch.Tensor | None:
        buf = self.buffers.get(path)
        return buf if buf is not None and buf.numel() == nbytes else None

    def count(self, n: int, memory: bool, peer: bool = False) -> None:
        with self._lock:
            if peer:
                self.from_peers += n
            elif memory:
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
    """Chunk ``d`` into ``dest``: from the node's memory where ``resident`` holds it (checked
    against its digest), else from the store; counted by ``resident``."""
    src = resident.chunks.get(d) if resident is not None else None
    if resident is not None and src is not None and len(src) == n:
        resident.take(repo, d, n, dest, src)
        return
    if resident is not None and resident.peers is not None and resident.peers.read(d, dest):
        # checked here: what another node sent is taken only when it matches its digest
        checked = take_chunk(repo, d, n, dest, None, resident.name_key)
        resident.count(n, memory=checked, peer=checked)
        return
    read_chunk(repo, d, n, dest)
    if resident is not None:
        resident.count(n, memory=False)


def host_copy(tier: HostTier | None, name_key: bytes | None,
              peers: PeerReader | None = None) -> Resident | None:
    """What ``ciuic run`` holds in host memory for a restore: the buffers a previous process of
    this rank left (adopted by this one), the chunks every rank of the node published, and
    (``peers``) what the other nodes hold. None outside ``ciuic run`` or without its tier; a
    Resident holding nothing counts the bytes read from the store."""
    if tier is None or not tier.enabled:
        return None
    own = dict(tier.adopted) if tier.snapshot is not None else {}
    return Resident(tier.snapshot, own, name_key, tier.node_chunks(), peers)


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

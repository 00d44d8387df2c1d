"""Where a restore's leaf bytes come from and land, besides fresh memory: the store (each chunk
read and verified against its name), the host memory ``ciuic run`` keeps of the latest
snapshots (:class:`Resident`: this rank's staged leaves and the node's published chunks, each
chunk checked against its digest before use), and buffers lent for the reads
(:data:`BufferFor`; :func:`lend_staging`: the staging buffers the next snapshot copies into).
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ciuic.chain.packreads import PackRuns
from ciuic.chain.read import read_chunk, take_chunk
from ciuic.chain.repo import Repository
from ciuic.format.descriptor import ChunkRef

if TYPE_CHECKING:  # types only: the readers (ciuic restore --to, diff) need neither at run time
    from ciuic.engine import StagingArea
    from ciuic.supervisor.fetched import NodeReads
    from ciuic.supervisor.hostcopy import HostTier

#: ``buffer_for(path, nbytes)``: a flat uint8 buffer to read a leaf into, or None (the reader
#: allocates one)
BufferFor = Callable[[str, int], "torch.Tensor | None"]


class Source(enum.Enum):
    """Where a chunk of a restore came from (the recovery log's three figures)."""

    #: this node's memory: its ranks' published chunks, this rank's staged leaves, and chunks
    #: another rank of the node already fetched from another node
    MEMORY = "memory"
    #: another node's memory: the bytes crossed the network for this read (once per node)
    PEER = "peer"
    STORE = "store"


class Resident:
    """A snapshot's bytes already in host memory (``ciuic run``'s host-memory tier): the
    leaves a previous process of this rank staged (by path: ``buffers``, only for the snapshot
    they hold) and every chunk the node's ranks published (by digest: ``chunks``, for any
    snapshot that holds them; ``load_chunks`` maps them on first use instead, where this rank
    is alone on its node). A restore takes each chunk from here after checking it against its
    digest, and reads a chunk that differs, or is not here, from the store; the bytes from
    each source are counted."""

    def __init__(self, snapshot: str | None, buffers: dict[str, torch.Tensor],
                 name_key: bytes | None, chunks: dict[str, memoryview] | None = None,
                 peers: NodeReads | None = None,
                 load_chunks: Callable[[], dict[str, memoryview]] | None = None,
                 holder: str = "ciuic run") -> None:
        self.snapshot = snapshot
        #: whose memory it is, for the recovery log
        self.holder = holder
        self.buffers = buffers
        self._chunks = chunks
        self._load_chunks = load_chunks
        #: the other nodes' memory, through this node's ciuic run (a job of several nodes)
        self.peers = peers
        self.name_key = name_key
        self.from_memory = 0  # bytes
        self.from_peers = 0
        self.from_store = 0
        #: the reference of each chunk this memory served (a rollback's, checked in the store
        #: afterwards: memory served it, so the restore did not see the store's copy)
        self.served: list[ChunkRef] = []
        self._lock = threading.Lock()

    @property
    def chunks(self) -> dict[str, memoryview]:
        """Every chunk the node's ranks published, by digest (mapped on first use where
        ``load_chunks`` was given)."""
        if self._chunks is None:
            with self._lock:
                if self._chunks is None:
                    self._chunks = self._load_chunks() if self._load_chunks is not None else {}
        return self._chunks

    def loaded(self) -> dict[str, memoryview]:
        """The node's published chunks where they are mapped already (else none: asking for
        :attr:`chunks` maps them)."""
        return self._chunks or {}

    def serving(self, snapshot: str) -> Resident | None:
        """What serves a restore of ``snapshot`` (fresh counts): the leaves by path only when
        they hold it; the chunks by digest whatever it is. None where memory holds nothing."""
        buffers = self.buffers if snapshot == self.snapshot else {}
        lazy = self._chunks is None and self._load_chunks is not None
        if not buffers and not lazy and not self.chunks and self.peers is None:
            return None
        return Resident(snapshot, buffers, self.name_key, self._chunks, self.peers,
                        self._load_chunks, self.holder)

    def held(self) -> int:
        """Bytes of the state this memory holds (the larger of the two views of it; the
        leaves alone where the chunks are mapped only on first use)."""
        leaves = sum(b.numel() for b in self.buffers.values())
        if self._chunks is None:
            return leaves
        return max(leaves, sum(len(v) for v in self._chunks.values()))

    def get(self, path: str, nbytes: int) -> torch.Tensor | None:
        buf = self.buffers.get(path)
        return buf if buf is not None and buf.numel() == nbytes else None

    def count(self, n: int, source: Source) -> None:
        with self._lock:
            if source is Source.PEER:
                self.from_peers += n
            elif source is Source.MEMORY:
                self.from_memory += n
            else:
                self.from_store += n

    def take(self, repo: Repository, ref: ChunkRef, dest: memoryview,
             src: memoryview | None, source: Source = Source.MEMORY) -> None:
        """Chunk ``ref`` into ``dest``: from ``src`` (memory; None: ``dest`` holds it already)
        when it matches its digest, counted as ``source``, else read from the store."""
        n = ref.nbytes
        served = take_chunk(repo, ref.digest, n, dest, src, self.name_key, ref)
        self.count(n, source if served else Source.STORE)
        if served:
            with self._lock:
                self.served.append(ref)


def read_from(repo: Repository, resident: Resident | None, ref: ChunkRef,
              dest: memoryview, runs: PackRuns | None = None) -> None:
    """Chunk ``d`` into ``dest``: from the node's memory where ``resident`` holds it, else
    from another node's memory through this node's ``ciuic run`` (which fetches it once for
    all of the node's ranks), checked against its digest either way, else from the store (a
    piece in a pack from its run of ``runs``, where the restore registered it there);
    counted by ``resident``. A chunk another rank of the node fetched counts as this node's
    memory: "from other nodes' memory" counts the bytes that crossed the network."""
    d, n = ref.digest, ref.nbytes
    if resident is not None:
        src = resident.chunks.get(d)
        if src is not None and len(src) == n:
            resident.take(repo, ref, dest, src)
            return
        came = resident.peers.read(d, dest) if resident.peers is not None else None
        if came is not None:
            resident.take(repo, ref, dest, None, Source.PEER if came == "fetched"
                          else Source.MEMORY)
            return
    if runs is not None and ref.pack is not None:
        runs.read(ref, dest)
    else:
        read_chunk(repo, d, n, dest, ref)
    if resident is not None:
        resident.count(n, Source.STORE)


def pack_runs(repo: Repository, resident: Resident | None, refs: Iterable[ChunkRef]
              ) -> PackRuns | None:
    """The runs of the packed pieces among ``refs`` that a restore reads from the store (those
    the node's memory holds by digest, where it has them mapped already, are left out); None
    where no piece is in a pack."""
    held = resident.loaded() if resident is not None else {}
    packed = [ref for ref in refs if ref.pack is not None and ref.digest not in held]
    return PackRuns(repo, packed) if packed else None


def host_copy(tier: HostTier | None, name_key: bytes | None,
              peers: NodeReads | None = None) -> Resident | None:
    """What ``ciuic run`` holds in host memory for a restore: the buffers a previous process of
    this rank left (adopted by this one), the chunks every rank of the node published, and
    (``peers``) what the other nodes hold. None outside ``ciuic run`` or without its tier; a
    Resident holding nothing counts the bytes read from the store. A rank alone on its node
    (no other ranks, no other nodes) asks for the node's chunks only when its own leaves do
    not serve a read, and not at all when it left none: the node's index then holds nothing
    for it."""
    if tier is None or not tier.enabled:
        return None
    own = dict(tier.adopted) if tier.snapshot is not None else {}
    if peers is None and _alone_on_node():
        if not own:
            return Resident(tier.snapshot, own, name_key, {})
        return Resident(tier.snapshot, own, name_key, None, None, tier.node_chunks)
    return Resident(tier.snapshot, own, name_key, tier.node_chunks(), peers)


def staged_copy(staging: StagingArea, name_key: bytes | None) -> Resident | None:
    """What this process's staging buffers still hold of the snapshots it wrote: a restore in
    the same process (a rollback, ``restore(snapshot="healthy")`` after a loss spike) takes
    every chunk they hold from memory, checked against its digest, and reads only the rest from
    the store. None when they hold nothing."""
    chunks = staging.held_chunks()
    if not chunks:
        return None
    return Resident(None, {}, name_key, chunks, holder="this process's staging buffers")


def _alone_on_node() -> bool:
    """Whether this process is the only rank on its node (not under torchrun, or torchrun
    with one process per node)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) <= 1
    except ValueError:
        return False


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

"""Resumable data position.

:class:`ResumableSampler` is a drop-in sampler whose order is a pure function of
``(seed, epoch)`` and whose position is part of the snapshot, so a resumed run sees exactly the
samples the uninterrupted run would have seen. Pass it to ``step()``/``restore()`` as an extra
(``sampler=...``).

Several ranks: ``num_replicas`` and ``rank`` split each epoch's order between the ranks exactly
as torch's ``DistributedSampler`` does (the same permutation, padding and ``drop_last``, rank
``r`` taking every ``num_replicas``-th index from ``r``; ``set_epoch`` too), so it replaces a
``DistributedSampler`` without changing what any rank sees, and resumes mid-epoch, which a
``DistributedSampler`` cannot (it keeps no position; ciuic refuses it as an extra and says so).
Every rank gives the same ``seed``. A snapshot taken on N ranks resumes on M mid-epoch exactly:
the indices the N ranks handed out together are the epoch order's first ones, and the M ranks
split the rest of the epoch between them (nothing skipped, nothing seen twice but the padding
``DistributedSampler`` would add to give every rank as many); the next epoch is split as usual.

Its position counts the indices it has *handed out*. With ``DataLoader(num_workers>0)`` the loader
asks for indices ahead of the batches the loop has consumed, so for worker-based loading use
torchdata's ``StatefulDataLoader`` (also an extra with ``state_dict``), or call
:meth:`ResumableSampler.consumed` with the number of samples the loop has really consumed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

log = logging.getLogger("ciuic")


class ResumableSampler(Sampler[int]):
    """A (shuffled) sampler that resumes mid-epoch, optionally this rank's share of the data.

    Args:
        data_source: the dataset (only its length is used) or an int length.
        shuffle: permute each epoch (seeded by ``seed + epoch``), else sequential order.
        seed: base seed of the permutation (the same on every rank when splitting).
        num_replicas, rank: split each epoch between ``num_replicas`` ranks and yield rank
            ``rank``'s share, as ``DistributedSampler`` does; by default the whole dataset.
            Under torchrun: ``num_replicas=dist.get_world_size(), rank=dist.get_rank()``.
        drop_last: with ``num_replicas``, drop the tail that does not divide evenly instead of
            padding with the epoch's first indices (``DistributedSampler``'s option).

    The epoch advances by itself at the end of each pass; :meth:`set_epoch` (a loop written for
    ``DistributedSampler``) sets it, and keeps the position when it names the current epoch, so
    that ``for epoch in range(sampler.epoch, n): sampler.set_epoch(epoch)`` after a restore
    finishes the interrupted epoch.
    """

    def __init__(self, data_source: Sized | int, shuffle: bool = True, seed: int = 0, *,
                 num_replicas: int | None = None, rank: int | None = None,
                 drop_last: bool = False) -> None:
        self.length = data_source if isinstance(data_source, int) else len(data_source)
        self.shuffle = shuffle
        self.seed = seed
        if (num_replicas is None) != (rank is None):
            raise ValueError("give both num_replicas and rank (this rank's share), or neither "
                             "(the whole dataset)")
        self.num_replicas = 1 if num_replicas is None else num_replicas
        self.rank = 0 if rank is None else rank
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} of num_replicas {self.num_replicas}: the rank "
                             f"must be at least 0 and less than num_replicas, which is at least 1")
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # indices of the current epoch already handed out (this rank's)
        #: where in the epoch's order this split of it starts: 0, or after a restore onto
        #: another number of ranks mid-epoch, the indices every rank together had handed out
        self.offset = 0

    @property
    def num_samples(self) -> int:
        """This rank's indices per epoch (``DistributedSampler.num_samples``); of what is left
        of it in an epoch resumed on another number of ranks."""
        left = max(0, self.length - self.offset)
        if self.drop_last:
            return left // self.num_replicas
        return math.ceil(left / self.num_replicas)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the current epoch keeps its position."""
        if epoch != self.epoch:
            self.epoch, self.position, self.offset = epoch, 0, 0

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        order = order[self.offset:]  # (all of it, but in an epoch resumed on other ranks)
        total = self.num_samples * self.num_replicas
        if total > len(order) and order:  # padded with the epoch's first indices
            order += (order * math.ceil(total / len(order)))[:total - len(order)]
        return order[self.rank:total:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        while self.position < len(order):
            i = order[self.position]
            self.position += 1
            yield i
        self.epoch += 1
        self.position = self.offset = 0

    def consumed(self, n: int) -> None:
        """Set the position to ``n`` samples consumed in the current epoch (prefetch-aware use)."""
        self.position = n

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "length": self.length,
                "num_replicas": self.num_replicas, "drop_last": self.drop_last,
                "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["length"] != self.length:
            raise ValueError(f"sampler was saved over {state['length']} samples, this dataset has "
                             f"{self.length}")
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.drop_last = bool(state.get("drop_last", self.drop_last))
        position, saved = int(state["position"]), int(state.get("num_replicas", 1))
        offset = int(state.get("offset", 0))
        if saved == self.num_replicas:
            self.position, self.offset = position, offset
            return
        # the ranks together handed out the first ``offset + position * saved`` indices of
        # the epoch's order (every rank as many: they step together); the new ranks split the
        # rest between them as DistributedSampler splits an epoch (padded with the rest's
        # first indices, or its tail dropped, so that every rank gets as many)
        self.offset = min(self.length, offset + position * saved)
        self.position = 0
        log.info("the sampler's epoch %d was split between %d ranks, now %d: the %d indices "
                 "handed out are skipped, the %d left are split between the %d ranks",
                 self.epoch, saved, self.num_replicas, self.offset, self.length - self.offset,
                 self.num_replicas)

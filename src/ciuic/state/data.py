"""Resumable data position.

:class:`ResumableSampler` is a drop-in sampler whose order is a pure function of
``(seed, epoch)`` and whose position is part of the snapshot, so a resumed run sees exactly the
samples the uninterrupted run would have seen. Pass it to ``step()``/``restore()`` as an extra
(``sampler=...``).

Its position counts the indices it has *handed out*. With ``DataLoader(num_workers>0)`` the loader
asks for indices ahead of the batches the loop has consumed, so for worker-based loading use
torchdata's ``StatefulDataLoader`` (also an extra with ``state_dict``), or call
:meth:`ResumableSampler.consumed` with the number of samples the loop has really consumed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """A (shuffled) sampler that resumes mid-epoch.

    Args:
        data_source: the dataset (only its length is used) or an int length.
        shuffle: permute each epoch (seeded by ``seed + epoch``), else sequential order.
        seed: base seed of the permutation.
    """

    def __init__(self, data_source: Sized | int, shuffle: bool = True, seed: int = 0) -> None:
        self.length = data_source if isinstance(data_source, int) else len(data_source)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # indices of the current epoch already handed out

    def __len__(self) -> int:
        return self.length

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        while self.position < self.length:
            i = order[self.position]
            self.position += 1
            yield i
        self.epoch += 1
        self.position = 0

    def consumed(self, n: int) -> None:
        """Set the position to ``n`` samples consumed in the current epoch (prefetch-aware use)."""
        self.position = n

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "length": self.length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["length"] != self.length:
            raise ValueError(f"sampler was saved over {state['length']} samples, this dataset has "
                             f"{self.length}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])

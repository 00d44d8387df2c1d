"""The integration tests' data: a fixed random classification set whose ``__getitem__`` adds
noise from torch's global RNG (a random augmentation: a resume is exact only if the RNG comes
back too)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]

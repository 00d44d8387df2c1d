"""The tiny models the tests train: seeded stacks of ``nn.Linear`` and their optimizer, in one
place. A test names the widths (sizes and counts that it asserts depend on them) and the seed;
a file that builds one model throughout binds them once
(``model_opt = partial(models.model_opt, 300, 300)``). A model of another shape (a ReLU, a
BatchNorm, tied weights) stays in the test that needs it."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
from torch import nn


def linear(*widths: int, seed: int | None = 0) -> nn.Module:
    """``nn.Linear(widths[0], widths[1])`` for two widths, else an ``nn.Sequential`` of
    ``nn.Linear(widths[i], widths[i + 1])``; drawn just after ``torch.manual_seed(seed)``
    (after nothing with ``seed=None``)."""
    if len(widths) < 2:
        raise ValueError(f"a model needs at least two widths, not {widths}")
    if seed is not None:
        torch.manual_seed(seed)
    layers = [nn.Linear(a, b) for a, b in pairwise(widths)]
    return layers[0] if len(layers) == 1 else nn.Sequential(*layers)


def model_opt(*widths: int, seed: int | None = 0,
              optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
              **options: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``linear(*widths, seed=seed)`` and an optimizer of its parameters: ``optimizer`` with
    ``options`` (SGD at lr 0.1 unless told otherwise)."""
    model = linear(*widths, seed=seed)
    if optimizer is torch.optim.SGD:
        options.setdefault("lr", 0.1)
    return model, optimizer(model.parameters(), **options)


def model_opt_stepped(*widths: int, batch: int, seed: int | None = 0,
                      optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
                      **options: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model_opt(...)`` after one step, so that the optimizer has state: the sum of the
    model's output for ``torch.randn(batch, widths[0])``, backward, ``optimizer.step()``."""
    model, opt = model_opt(*widths, seed=seed, optimizer=optimizer, **options)
    model(torch.randn(batch, widths[0])).sum().backward()
    opt.step()
    return model, opt

"""Data position: a resumed run sees exactly the samples the uninterrupted run would have."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from ciuic import ResumableSampler, SnapshotManager


def batches_of(loader: DataLoader[int], n: int,
               it: object = None) -> tuple[list[list[int]], object]:
    it = it if it is not None else iter(loader)
    out: list[list[int]] = []
    while len(out) < n:
        try:
            out.append(next(it).tolist())  # type: ignore[call-overload]
        except StopIteration:
            it = iter(loader)
    return out, it


def loader_with(sampler: ResumableSampler) -> DataLoader[int]:
    return DataLoader(list(range(50)), batch_size=4, sampler=sampler,  # type: ignore[arg-type]
                      generator=torch.Generator())


def test_resumable_sampler_resumes_mid_epoch_twice(tmp_path: Path) -> None:
    reference, _ = batches_of(loader_with(ResumableSampler(50, seed=3)), 40)  # ~3 epochs
    seen: list[list[int]] = []
    for stop in (9, 23, 40):  # two interruptions, the second in another epoch
        sampler = ResumableSampler(50, seed=3)
        with SnapshotManager("p", job="data", store=tmp_path / "s") as m:
            m.restore(sampler=sampler)
            got, _ = batches_of(loader_with(sampler), stop - len(seen))
            seen += got
            m.save(len(seen), sampler=sampler)
    assert seen == reference


def test_sampler_is_deterministic_and_checks_length() -> None:
    a, b = ResumableSampler(10, seed=1), ResumableSampler(10, seed=1)
    assert list(a) == list(b) and a.epoch == 1
    assert list(a) != list(ResumableSampler(10, seed=1))  # epoch 1 differs from epoch 0
    assert list(ResumableSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="saved over 10 samples, this dataset has 11"):
        ResumableSampler(11).load_state_dict(a.state_dict())


def test_stateful_dataloader_with_workers_resumes_twice(tmp_path: Path) -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> DataLoader[int]:
        loader: DataLoader[int] = sdl.StatefulDataLoader(
            list(range(60)), batch_size=4, shuffle=True, num_workers=2,
            generator=torch.Generator().manual_seed(5))
        return loader

    reference, _ = batches_of(make(), 35)
    seen: list[list[int]] = []
    for stop in (7, 19, 35):
        loader = make()
        with SnapshotManager("p", job="sdl", store=tmp_path / "s") as m:
            m.restore(loader=loader)
            got, _ = batches_of(loader, stop - len(seen))
            seen += got
            m.save(len(seen), loader=loader)
    assert seen == reference

"""FetchRng: the RNG at each batch fetch recorded, and replayed after a restore, so that a
dataset drawing its augmentation from the global RNGs gives the uninterrupted run's batches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ciuic.errors import ConfigurationError
from ciuic.state.capture import rng_state, set_rng_state
from ciuic.state.replay import FetchRng


class Noisy(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return i + torch.rand(())  # augmentation from the global RNG


def ahead(loader: DataLoader[Any]) -> Iterator[torch.Tensor]:
    """Yield batches one fetch ahead, as accelerate's DataLoaderShard does."""
    it = iter(loader)
    current = next(it, None)
    while current is not None:
        following = next(it, None)
        yield current
        current = following


def run(epochs: int, stop: tuple[int, int] | None = None, resume: Any = None,
        shuffle: bool = False, skip: bool = False, generator: bool = False,
        late: bool = False) -> tuple[list[torch.Tensor], Any]:
    """Train-like loop: per batch one more RNG draw (dropout). ``stop=(epoch, step)``: return the
    snapshot (RNG + FetchRng state) taken after that step; ``resume``: start from one.
    ``shuffle``: the order from the global RNG, or with ``generator`` from the loader's own;
    ``late``: the loader is attached after the restore (as Lightning's is)."""
    loader = DataLoader(Noisy(), batch_size=4, shuffle=shuffle,
                        generator=torch.Generator() if generator else None)
    fetch = FetchRng(skip=skip)
    if not late:
        assert fetch.attach_loader(loader)
    seen: list[torch.Tensor] = []
    start_epoch, skip_n = 0, 0
    if resume is not None:
        (start_epoch, skip_n), rng, data = resume
        fetch.load_state_dict(data)
        set_rng_state(rng)
        fetch.restored()
    else:
        torch.manual_seed(0)
    if late:
        assert fetch.attach_loader(loader)
    for epoch in range(start_epoch, epochs):
        for step, batch in enumerate(ahead(loader), 1 + (skip_n if skip else 0)):
            if not skip and epoch == start_epoch and step <= skip_n:
                continue  # consumed before the snapshot (the loop skips them)
            seen.append(batch + torch.rand(()))  # the training step's own draw
            if stop == (epoch, step):
                fetch.at(step if step < len(loader) else 0)
                at = (epoch, step) if step < len(loader) else (epoch + 1, 0)
                return seen, (at, rng_state(), fetch.state_dict())
        skip_n = 0
    return seen, None


@pytest.mark.parametrize(("shuffle", "skip", "generator", "late"), [
    (False, False, False, False), (True, False, False, False), (True, True, False, False),
    (True, False, True, False), (True, True, True, True)],
    ids=["in-order", "shuffled-by-the-global-rng", "the-sampler-skips",
         "shuffled-by-the-loader-generator", "the-loader-generator-attached-after-the-restore"])
def test_resuming_mid_pass_and_at_a_pass_end_gives_the_same_batches(
        shuffle: bool, skip: bool, generator: bool, late: bool) -> None:
    full, _ = run(3, None, None, shuffle, skip, generator, late)
    for stop in [(1, 2), (0, 5), (1, 6), (2, 1)]:
        before, snap = run(3, stop, None, shuffle, skip, generator, late)
        after, _ = run(3, None, snap, shuffle, skip, generator, late)
        assert len(before) + len(after) == len(full)
        assert all(torch.equal(a, b) for a, b in zip(before + after, full, strict=True)), stop


def test_without_the_replay_the_batches_differ() -> None:
    full, _ = run(2)
    before, (at, rng, _) = run(2, stop=(1, 2))
    after, _ = run(2, resume=(at, rng, {"consumed": 0, "pending": []}))
    assert not all(torch.equal(a, b) for a, b in zip(before + after, full, strict=True))


def test_a_loader_without_batch_sampler_is_not_hooked() -> None:
    assert FetchRng().attach(None) is False


def test_a_snapshot_without_the_loader_generators_state_resumes_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    loader = DataLoader(Noisy(), batch_size=4, shuffle=True, generator=torch.Generator())
    fetch = FetchRng()
    assert fetch.attach_loader(loader) and fetch.generators == [loader.generator]
    fetch.load_state_dict({"consumed": 0, "pending": [], "generators": []})  # an older ciuic's
    assert "holds no state of the data loader's 1 generator (" in caplog.text
    with pytest.raises(ConfigurationError, match="holds the state of 2 data loader generator"):
        fetch.load_state_dict({"consumed": 0, "pending": [], "generators": [
            loader.generator.get_state()] * 2})

"""A snapshot taken after the last batch of an epoch resumes at the next epoch's first batch,
whichever way the loop finds its epoch (issue 44: Megatron's loop lost an epoch whole); a
position started over (another data split's, after a data-parallel change) is not used."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from ciuic.integrations._loaders import LoaderPosition
from ciuic.state.capture import rng_state, set_rng_state
from ciuic.state.data import ResumableSampler

BATCHES = 5  # per epoch: 10 samples, 2 per batch


class Noisy(torch.utils.data.Dataset[torch.Tensor]):
    """Each sample drawn with noise from torch's global RNG at fetch (an augmentation)."""

    def __len__(self) -> int:
        return 2 * BATCHES

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(float(i)) + torch.rand(())


def loader() -> tuple[DataLoader[torch.Tensor], DistributedSampler[Any], LoaderPosition]:
    sampler = DistributedSampler(Noisy(), num_replicas=1, rank=0, shuffle=True, seed=3)
    dl = DataLoader(Noisy(), batch_size=2, sampler=sampler)
    return dl, sampler, LoaderPosition(dl)


def epoch_loop(epochs: int, *, iteration: int | None = None, snapshot_at: int | None = None,
               state: dict[str, Any] | None = None) -> tuple[list[list[float]], Any]:
    """The batches a loop sees, and the snapshot after batch ``snapshot_at`` of an
    uninterrupted run. Its first epoch: with ``iteration``, Megatron-LM's convention (the
    iteration // batches per epoch, the consumed samples), set on the sampler before each
    pass; without, the loader position's (the DeepSpeed integration's ``restore()`` returns
    it), finishing the interrupted epoch."""
    dl, sampler, position = loader()
    if state is not None:
        position.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        position.fetch.restored()
    seen: list[list[float]] = []
    saved = None
    first = position.epoch if iteration is None else iteration // BATCHES
    for epoch in range(first, epochs):
        sampler.set_epoch(epoch)
        for batch in dl:
            seen.append(batch.tolist())
            if len(seen) == snapshot_at:
                saved = {"loader": position.state_dict(), "rng": rng_state()}
    return seen, saved


@pytest.mark.parametrize("at", [BATCHES, 3, 2 * BATCHES - 1])
def test_megatrons_loop_resumes_at_the_next_batch_also_at_an_epochs_end(at: int) -> None:
    torch.manual_seed(0)
    whole, saved = epoch_loop(3, iteration=0, snapshot_at=at)
    torch.manual_seed(123)  # another process: the snapshot's RNG is what counts
    rest, _ = epoch_loop(3, iteration=at, state=saved)
    assert len(rest) == 3 * BATCHES - at  # no epoch skipped
    assert rest == whole[at:]


@pytest.mark.parametrize("at", [BATCHES, 3])
def test_a_loop_that_finishes_the_interrupted_epoch_resumes_exactly(at: int) -> None:
    torch.manual_seed(0)
    whole, saved = epoch_loop(3, snapshot_at=at)
    torch.manual_seed(123)
    rest, _ = epoch_loop(3, state=saved)
    assert rest == whole[at:]


def test_a_resumable_sampler_at_an_epochs_end_serves_both_conventions() -> None:
    s = ResumableSampler(10, seed=1)
    indices = iter(s)
    for _ in range(10):  # every index of epoch 0 handed out, the pass not yet ended
        next(indices)
    state = s.state_dict()
    assert (state["epoch"], state["position"]) == (0, 10)
    finish = ResumableSampler(10, seed=1)
    finish.load_state_dict(state)
    finish.set_epoch(0)  # a loop that finishes the interrupted epoch: nothing left of it
    assert list(finish) == [] and finish.epoch == 1
    nxt = ResumableSampler(10, seed=1)
    nxt.load_state_dict(state)
    nxt.set_epoch(1)  # a loop that takes the epoch from the iteration
    fresh = ResumableSampler(10, seed=1)
    fresh.set_epoch(1)
    assert list(nxt) == list(fresh)


def test_a_position_started_over_begins_the_pass_the_loop_sets_at_its_first_batch() -> None:
    """After a data-parallel change (MegatronSnapshots) a saved position is another split's:
    ``start_over`` drops it, and the next pass is the epoch the loop set, whole, from its first
    batch, where the restored position alone would have skipped the batches it had consumed."""
    torch.manual_seed(0)
    _, saved = epoch_loop(1, iteration=0, snapshot_at=3)  # 3 of epoch 0's 5 batches trained
    assert saved is not None and saved["loader"]["consumed"] == 3

    def first_pass(start_over: bool) -> list[list[float]]:
        dl, sampler, position = loader()
        position.load_state_dict(saved["loader"])
        set_rng_state(saved["rng"])
        position.fetch.restored()
        if start_over:
            position.start_over()
        sampler.set_epoch(0)
        return [b.tolist() for b in dl]

    assert len(first_pass(start_over=False)) == BATCHES - 3  # the position skips by itself
    whole = first_pass(start_over=True)
    assert len(whole) == BATCHES
    dl, sampler, _ = loader()
    sampler.set_epoch(0)  # the samples (a sample's value is its index plus noise in [0, 1))
    assert [[int(x) for x in b] for b in whole] == [[int(x) for x in b.tolist()] for b in dl]

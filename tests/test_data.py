"""Data position: a resumed run sees exactly the samples the uninterrupted run would have."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from ciuic import ResumableSampler, SnapshotManager
from tests.helpers.noisy import Noisy


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


@pytest.mark.parametrize(("length", "shuffle", "drop_last"), [
    (50, True, False), (50, True, True), (48, False, False), (7, True, False)])
def test_split_between_ranks_it_yields_what_a_distributed_sampler_yields(
        length: int, shuffle: bool, drop_last: bool) -> None:
    """Issue 42: ResumableSampler had no num_replicas/rank. Split, each rank gets exactly
    DistributedSampler's indices, epoch by epoch through set_epoch, and the ranks' shares
    cover the epoch."""
    from torch.utils.data import DistributedSampler

    for epoch in range(3):
        shares = []
        for rank in range(3):
            ours = ResumableSampler(length, shuffle, seed=7, num_replicas=3, rank=rank,
                                    drop_last=drop_last)
            theirs = DistributedSampler(range(length), num_replicas=3, rank=rank,
                                        shuffle=shuffle, seed=7, drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)
            assert ours.epoch == epoch + 1 and ours.position == 0
            shares += list(theirs)
        if drop_last:  # each index at most once, the tail that does not divide left out
            assert len(set(shares)) == len(shares) == length - length % 3
        else:  # every index, the padding repeating the first ones
            assert set(shares) == set(range(length)) and len(shares) == -(-length // 3) * 3


def test_a_split_sampler_resumes_mid_epoch_on_as_many_on_more_or_on_fewer_ranks() -> None:
    """The position is each rank's; on another world size the new ranks split what the epoch
    had not handed out over all the old ranks: nothing skipped, nothing repeated (but the
    padding that gives every rank as many), whether or not the counts divide; the next epoch
    is split as usual."""
    def ranks(n: int, epoch: int = 1) -> list[ResumableSampler]:
        out = [ResumableSampler(40, seed=2, num_replicas=n, rank=r) for r in range(n)]
        for s in out:
            s.set_epoch(epoch)
        return out

    full = [i for s in ranks(1) for i in s]
    saved = ranks(2)
    handed = [[next(it) for _ in range(6)] for it in map(iter, saved)]
    assert sorted(handed[0] + handed[1]) == sorted(full[:12])
    for n in (2, 4):
        resumed = ranks(n, epoch=0)  # the epoch comes from the snapshot
        for r, s in enumerate(resumed):
            s.load_state_dict(saved[r % 2].state_dict())
            assert s.epoch == 1
        rest = [i for s in resumed for i in s]
        assert sorted(rest) == sorted(full[12:]), n
    for n in (3, 5):  # 28 left: 10 a rank (2 padded) on 3 ranks, 6 (2 padded) on 5
        resumed = ranks(n, epoch=0)
        for r, s in enumerate(resumed):
            s.load_state_dict(saved[r % 2].state_dict())
        shares = [list(s) for s in resumed]
        assert len({len(x) for x in shares}) == 1, n  # every rank as many
        rest = [i for x in shares for i in x]
        assert set(rest) == set(full[12:]) and len(rest) == -(-28 // n) * n, n
        # saved again mid-way and resumed on yet another number of ranks: still exact
    three = ranks(3, epoch=0)
    for r, s in enumerate(three):
        s.load_state_dict(saved[r % 2].state_dict())
    taken = [[next(it) for _ in range(4)] for it in map(iter, three)]  # 12 more of the 28
    two = ranks(2, epoch=0)
    for r, s in enumerate(two):
        s.load_state_dict(three[r].state_dict())
    rest = [i for s in two for i in s]
    assert sorted(handed[0] + handed[1] + [i for x in taken for i in x] + rest) == sorted(full)
    assert all(s.epoch == 2 and s.offset == 0 for s in two)  # the next epoch: split as usual
    assert [len(list(s)) for s in two] == [20, 20]
    with pytest.raises(ValueError, match="both num_replicas and rank"):
        ResumableSampler(10, num_replicas=2)
    with pytest.raises(ValueError, match="rank 2 of num_replicas 2"):
        ResumableSampler(10, num_replicas=2, rank=2)


def test_set_epoch_keeps_the_position_of_the_current_epoch() -> None:
    """A loop written for DistributedSampler calls set_epoch at each epoch's start: after a
    restore mid-epoch, set_epoch(sampler.epoch) must not start the epoch again."""
    s = ResumableSampler(10, seed=1)
    it = iter(s)
    first = [next(it) for _ in range(4)]
    state = s.state_dict()
    resumed = ResumableSampler(10, seed=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(resumed.epoch)
    assert first + list(resumed) == list(ResumableSampler(10, seed=1))
    resumed.set_epoch(5)
    assert resumed.position == 0 and list(resumed) == list(_at_epoch(5))


def test_a_sampler_state_saved_before_ranks_were_split_still_loads() -> None:
    """Snapshots taken before num_replicas existed hold no num_replicas nor drop_last."""
    s = ResumableSampler(10, seed=1)
    s.load_state_dict({"epoch": 2, "position": 3, "seed": 1, "shuffle": True, "length": 10})
    assert (s.epoch, s.position, s.num_replicas, s.drop_last) == (2, 3, 1, False)
    assert list(s) == list(_at_epoch(2))[3:]


def _at_epoch(epoch: int) -> ResumableSampler:
    s = ResumableSampler(10, seed=1)
    s.epoch = epoch
    return s


def test_a_distributed_sampler_as_an_extra_names_its_replacement(tmp_path: Path) -> None:
    from torch.utils.data import DistributedSampler

    from ciuic import CaptureError

    sampler = DistributedSampler(range(8), num_replicas=2, rank=0)
    refused = r"'sampler' is a DistributedSampler.*ResumableSampler\(dataset.*num_replicas"
    with SnapshotManager("p", job="j", store=tmp_path / "s", handle_signals=False) as manager, \
            pytest.raises(CaptureError, match=refused):
        manager.step(0, sampler=sampler, snapshot=True)


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


def quick_start(store: Path, stop_after: int | None = None
                ) -> tuple[int | None, dict[str, torch.Tensor]]:
    """The README's quick start, small: a ResumableSampler and the loader's own generator,
    augmentation and dropout from the global RNG, 3 epochs of 6 steps, snapshots every 4.
    ``stop_after``: stop after that step, without a snapshot of it (as a kill would). Returns
    the step it resumed from and the final weights."""
    torch.manual_seed(0)
    data = Noisy(24)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ResumableSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
    with SnapshotManager("p", job="quick", store=store, save_interval=4,
                         handle_signals=False) as manager:
        last = manager.restore(model, optimizer, sampler=sampler)
        step = 0 if last is None else last + 1
        while step < 18:
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                manager.step(step, model, optimizer, sampler=sampler)
                if step == stop_after:
                    manager.close(final=False)
                    return last, {}
                step += 1
                if step == 18:
                    break
    return last, {k: v.clone() for k, v in model.state_dict().items()}


def test_the_quick_start_stopped_mid_epoch_after_epoch_0_resumes_bit_exact(
        tmp_path: Path) -> None:
    """A ResumableSampler with the loader's own generator: the sampler's order is a function
    of its seed and epoch, the generator only seeds the loader's workers."""
    _, reference = quick_start(tmp_path / "a")
    quick_start(tmp_path / "b", stop_after=9)  # epoch 1, 4 batches in
    last, resumed = quick_start(tmp_path / "b")
    assert last == 8
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)


def test_a_plain_data_loader_as_an_extra_says_what_keeps_its_position(tmp_path: Path) -> None:
    from ciuic import CaptureError

    model = torch.nn.Linear(2, 2)
    loader: DataLoader[int] = DataLoader(list(range(8)), shuffle=True,  # type: ignore[arg-type]
                                         generator=torch.Generator())
    with SnapshotManager("p", job="j", store=tmp_path / "s", handle_signals=False) as manager:
        assert manager.restore(model, loader=loader) is None
        with pytest.raises(CaptureError, match=r"'loader' is a DataLoader.*ResumableSampler"):
            manager.step(0, model, loader=loader, snapshot=True)


def test_a_stateful_dataloader_with_its_own_generator_and_no_workers_drifts_after_its_epoch(
        tmp_path: Path) -> None:
    """torchdata's restore (``num_workers=0``) rewinds the generator to the epoch's start and
    draws the order again, but not the loader's base seed, drawn from the same generator after
    the order: the epochs after the resumed one are shuffled from another state. The README
    says so; this test fails once torchdata changes it."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> DataLoader[int]:
        loader: DataLoader[int] = sdl.StatefulDataLoader(
            list(range(12)), batch_size=4, shuffle=True, generator=torch.Generator())
        return loader

    reference, _ = batches_of(make(), 9)  # 3 epochs of 3 batches
    loader = make()
    with SnapshotManager("p", job="sdl", store=tmp_path / "s") as m:
        seen, _ = batches_of(loader, 4)  # epoch 1, 1 batch in
        m.save(4, loader=loader)
    loader = make()
    with SnapshotManager("p", job="sdl", store=tmp_path / "s") as m:
        m.restore(loader=loader)
        seen += batches_of(loader, 5)[0]
    assert seen[:6] == reference[:6]  # the resumed epoch
    assert seen[6:] != reference[6:]  # the next one

"""Overlapped staging (``overlap=True``): parameters and optimizer state are copied while the next
forward/backward runs, and the optimizer's next step waits for the copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ciuic import SnapshotManager, faults
from tests.models import linear


# not tests/models.py's: a BatchNorm, whose buffers the overlapped copy holds as well
def setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.BatchNorm1d(512), nn.Linear(512, 8))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(16, 256)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out |= {f"o.{i}.{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
    return out


def test_the_optimizer_waits_for_the_copy_so_the_snapshot_holds_the_step_values(
        store_dir: Path) -> None:
    model, opt = setup()
    train(model, opt)
    # The background copy sleeps first: the next optimizer step would overwrite the parameters
    # and the Adam moments under it, were it not held back by the pre-hook.
    faults.reload("stage.copy=sleep:0.5")
    with SnapshotManager("p", store=store_dir, save_interval=1, overlap=True,
                         handle_signals=False) as m:
        assert m.step(1, model, opt)
        expected = snapshot_of(model, opt)  # what step 1 was
        train(model, opt)  # forward/backward overlap the copy; opt.step() waits for it
        train(model, opt)
        m.wait()
        assert m.stats.failures == 0
        assert m.stats.overlap_wait_s > 0
    faults.reload("")
    fresh, fresh_opt = setup()
    with SnapshotManager("p", store=store_dir, handle_signals=False) as m:
        assert m.restore(fresh, fresh_opt) == 1
    got = snapshot_of(fresh, fresh_opt)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    assert not any(torch.equal(got[k], v) for k, v in snapshot_of(model, opt).items()
                   if k.startswith("m.0.weight"))  # training really moved on


def test_a_failed_background_copy_fails_the_snapshot_not_training(store_dir: Path) -> None:
    model, opt = setup()
    with SnapshotManager("p", store=store_dir, save_interval=1, overlap=True,
                         handle_signals=False) as m:
        train(model, opt)
        assert m.step(1, model, opt)
        m.wait()
        faults.reload("stage.copy=raise")
        train(model, opt)
        assert m.step(2, model, opt)
        train(model, opt)  # the hook swallows the copy's error: training goes on
        m.wait()
        faults.reload("")
        assert m.stats.failures == 1
        latest = m.latest()
        assert latest is not None and latest.step == 1


def test_without_an_optimizer_or_after_close_nothing_is_hooked(store_dir: Path) -> None:
    model, opt = setup()
    with SnapshotManager("p", store=store_dir, save_interval=1, overlap=True,
                         handle_signals=False) as m:
        train(model, opt)
        assert m.step(1, model)  # no optimizer given: staged synchronously
        m.wait()
        assert not opt._optimizer_step_pre_hooks
        assert m.step(2, model, opt)
        assert len(opt._optimizer_step_pre_hooks) == 1
    assert not opt._optimizer_step_pre_hooks  # close() removed the hook


def test_a_new_optimizer_that_reuses_an_id_still_waits_for_the_overlapped_copy(
        store_dir: Path) -> None:
    model = linear(256, 256)
    with SnapshotManager("p", job="ov", store=store_dir, save_interval=1, overlap=True,
                         compression="off") as m:
        old = torch.optim.SGD(model.parameters(), lr=1.0)
        m.step(1, model, old)
        m.wait()
        old_id = id(old)
        del old  # a new training phase, say
        opt = None
        for _ in range(1000):  # CPython soon gives a new object the freed one's address
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            if id(opt) == old_id:
                break
            opt = None
        if opt is None:
            pytest.skip("no new optimizer got the old one's id")
        faults.reload("stage.copy=sleep:0.5")  # a slow background copy
        try:
            m.step(2, model, opt)
            expected = model.weight.detach().clone()
            model.weight.grad = torch.ones_like(model.weight)
            opt.step()  # must wait for the copy of step 2's values
            m.wait()
        finally:
            faults.reload("")
        fresh = nn.Linear(256, 256)
        assert m.restore(fresh) == 2
    assert torch.equal(fresh.weight, expected)

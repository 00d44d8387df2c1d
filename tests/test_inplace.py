"""Restore reads straight into the live tensors (restore/inplace.py): the model's and the
optimizer's tensors keep their memory and receive the snapshot's bytes; a snapshot that does not
fit is refused before anything is read; a damaged one falls back to the previous one, which is
read into the same tensors; what cannot take the bytes as they are is read into fresh memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ciuic import RestoreError, SnapshotManager, StateMismatch
from ciuic.chain.read import chunk_refs, read_body
from tests.helpers.stored import flip, stored_at


# not tests/models.py's: a ReLU between the layers (keys 0.* and 2.*, as ``other`` below)
def trained(seed: int, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        step(model, opt)
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(8, 128)).square().mean().backward()
    opt.step()


def everything(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            out[f"opt.{i}.{k}"] = v.clone()
    return out


def pointers(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Where each tensor stored in chunks lives (the body holds tensors of up to 256 bytes
    inline: an optimizer takes those as new tensors)."""
    out = {f"model.{k}": v.data_ptr() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        out.update({f"opt.{i}.{k}": v.data_ptr() for k, v in opt.state[p].items()
                    if v.nbytes > 256})
    return out


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def saved_once(tmp_path: Path) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    """A store holding one snapshot (step 1) of a trained model and its optimizer."""
    store = tmp_path / "s"
    model, opt = trained(0)
    with SnapshotManager("p", job="j", store=store, save_interval=1) as m:
        m.save(1, model, opt)
    return store, model, opt


def damage_a_chunk_of(m: SnapshotManager, store: Path, info: object) -> None:
    _, states = read_body(m.repo, info)  # type: ignore[arg-type]
    ref = next(iter(chunk_refs(states["model"]).values()))
    flip(store, ref, stored_at(store, ref)[2] - 1, 1)


def test_the_bytes_land_in_the_tensors_the_model_and_optimizer_hold(tmp_path: Path) -> None:
    store, model, opt = saved_once(tmp_path)
    saved = everything(model, opt)
    live_model, live_opt = trained(7)  # a job that had taken a step: its optimizer has state
    before = pointers(live_model, live_opt)
    differ = [k for k, v in everything(live_model, live_opt).items()
              if not torch.equal(v, saved[k])]
    assert differ  # the live state differs from the snapshot before the restore
    with SnapshotManager("p", job="j", store=store) as m:
        assert m.restore(live_model, live_opt) == 1
    assert pointers(live_model, live_opt) == before  # the same memory, read into
    assert_equal(everything(live_model, live_opt), saved)
    torch.manual_seed(4)  # and it trains on as the saved run does
    step(live_model, live_opt)
    torch.manual_seed(4)
    step(model, opt)
    assert_equal(everything(live_model, live_opt), everything(model, opt))


def test_a_fresh_optimizer_gets_its_state_in_new_memory(tmp_path: Path) -> None:
    store, model, opt = saved_once(tmp_path)
    saved = everything(model, opt)
    live_model, _ = trained(5, steps=0)
    live_opt = torch.optim.AdamW(live_model.parameters(), lr=1e-3)  # no state yet
    params = [p.data_ptr() for p in live_model.parameters()]
    with SnapshotManager("p", job="j", store=store) as m:
        m.restore(live_model, live_opt)
    assert [p.data_ptr() for p in live_model.parameters()] == params
    assert_equal(everything(live_model, live_opt), saved)


def test_a_snapshot_that_does_not_fit_touches_nothing(tmp_path: Path) -> None:
    store, _, _ = saved_once(tmp_path)
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 32))  # last layer
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    step(other, other_opt)
    before = everything(other, other_opt)
    with SnapshotManager("p", job="j", store=store) as m, pytest.raises(
            StateMismatch, match="different shape") as e:
        m.restore(other, other_opt)
    assert "do not train on them" not in str(e.value)
    assert_equal(everything(other, other_opt), before)  # not a byte changed
    # an extra the snapshot lacks is refused before reading too
    live_model, live_opt = trained(3)
    before = everything(live_model, live_opt)
    with SnapshotManager("p", job="j", store=store) as m, pytest.raises(
            StateMismatch, match="no state for"):
        m.restore(live_model, live_opt, scheduler=torch.optim.lr_scheduler.StepLR(live_opt, 1))
    assert_equal(everything(live_model, live_opt), before)


def test_a_damaged_snapshot_falls_back_into_the_same_tensors(tmp_path: Path) -> None:
    store = tmp_path / "s"
    model, opt = trained(0)
    with SnapshotManager("p", job="j", store=store, save_interval=1) as m:
        m.save(1, model, opt)
        first = everything(model, opt)
        step(model, opt)
        bad = m.save(2, model, opt)
        damage_a_chunk_of(m, store, bad)
    live_model, live_opt = trained(9)
    before = pointers(live_model, live_opt)
    with SnapshotManager("p", job="j", store=store) as m:
        assert m.restore(live_model, live_opt) == 1
    assert pointers(live_model, live_opt) == before
    assert_equal(everything(live_model, live_opt), first)  # every byte of step 1, none of 2


def test_when_nothing_loads_the_error_says_the_tensors_were_read_into(tmp_path: Path) -> None:
    store = tmp_path / "s"
    model, opt = trained(0)
    with SnapshotManager("p", job="j", store=store, save_interval=1) as m:
        only = m.save(1, model, opt)
        damage_a_chunk_of(m, store, only)
    live_model, live_opt = trained(9)
    with SnapshotManager("p", job="j", store=store) as m, pytest.raises(
            RestoreError, match="none could be") as e:
        m.restore(live_model, live_opt)
    assert "hold part of a snapshot: do not train on them" in str(e.value)


def test_tied_and_odd_tensors_are_read_into_fresh_memory(tmp_path: Path) -> None:
    """Tied weights share memory: one path is read into it, the other into fresh memory, and
    load_state_dict leaves both right. A non-contiguous tensor cannot take the bytes as they
    are: it is copied into."""
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(300, 64)
            self.head = nn.Linear(64, 300, bias=False)
            self.head.weight = self.emb.weight
            self.register_buffer("odd", torch.randn(64, 128).t())  # not contiguous

    model = Tied()
    with SnapshotManager("p", job="t", store=tmp_path / "s", save_interval=1) as m:
        m.save(1, model)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    live = Tied()
    weight = live.emb.weight.data_ptr()
    with SnapshotManager("p", job="t", store=tmp_path / "s") as m:
        m.restore(live)
    assert live.emb.weight.data_ptr() == weight and live.head.weight is live.emb.weight
    for k, v in live.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert not live.odd.is_contiguous()


def test_optimizer_state_that_cannot_be_read_into_is_copied_into(tmp_path: Path) -> None:
    """A state tensor the bytes cannot land in as they are (here not contiguous; on a GPU, any)
    gets the loaded values copied in, and the optimizer keeps it: its memory is not allocated
    a second time."""
    store, model, opt = saved_once(tmp_path)
    saved = everything(model, opt)
    live_model, live_opt = trained(6)
    weight = next(live_model.parameters())
    odd = torch.empty(tuple(reversed(weight.shape))).t()  # the weight's shape, transposed memory
    odd.copy_(live_opt.state[weight]["exp_avg"])
    live_opt.state[weight]["exp_avg"] = odd
    with SnapshotManager("p", job="j", store=store) as m:
        m.restore(live_model, live_opt)
    assert live_opt.state[weight]["exp_avg"] is odd
    assert_equal(everything(live_model, live_opt), saved)

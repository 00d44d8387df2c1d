"""Capture and restore of the whole training state, in process."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ciuic import SnapshotManager, StateMismatch
from ciuic.restore.match import match_model_state
from ciuic.state.capture import capture


# not tests/models.py's: a BatchNorm's buffers, a scheduler and a GradScaler are captured too
def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, object, torch.amp.GradScaler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return model, opt, sched, scaler


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: object, n: int) -> None:
    for _ in range(n):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]


def test_capture_does_not_copy_or_write() -> None:
    model, opt, _, _ = make()
    cap = capture(model, opt, {"epoch": 3})
    weights = {leaf.path: leaf.value for leaf in cap.leaves}
    assert weights["model/0.weight"].data_ptr() == model[0].weight.data_ptr()
    assert cap.metrics == {"epoch": 3}
    assert set(cap.states) == {"model", "optimizer", "epoch", "rng"}


def test_full_state_round_trip_is_bit_exact(tmp_path: Path) -> None:
    model, opt, sched, scaler = make()
    train(model, opt, sched, 5)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=512.0)
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    with SnapshotManager("p", job="j", store=tmp_path / "s", save_interval=None) as m:
        m.save(5, model, opt, scheduler=sched, scaler=scaler, epoch=2, note="hi")
    expected_next = (random.random(), float(np.random.rand()), torch.rand(3))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = opt.state_dict()

    model2, opt2, sched2, scaler2 = make(seed=99)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    with SnapshotManager("p", job="j", store=tmp_path / "s") as m2:
        step = m2.restore(model2, opt2, scheduler=sched2, scaler=scaler2)
        assert step == 5
        assert m2.restored_values == {"epoch": 2, "note": "hi"}
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k]), k
        assert v.dtype == want[k].dtype
    got_opt = opt2.state_dict()
    for pid, st in want_opt["state"].items():
        for k, v in st.items():
            assert torch.equal(got_opt["state"][pid][k], v), (pid, k)
    assert got_opt["state"][0]["step"].item() == 5.0  # per-parameter step counters
    assert got_opt["param_groups"] == want_opt["param_groups"]  # lr, betas (cycled), ...
    assert isinstance(got_opt["param_groups"][0]["betas"], tuple)
    assert sched2.state_dict() == sched.state_dict()
    assert scaler2.get_scale() == 512.0
    assert (random.random(), float(np.random.rand())) == expected_next[:2]
    assert torch.equal(torch.rand(3), expected_next[2])


def test_dtypes_survive(tmp_path: Path) -> None:
    values = {
        "bf16": torch.randn(300, dtype=torch.bfloat16), "f16": torch.randn(7, dtype=torch.float16),
        "i64": torch.arange(100), "bool": torch.rand(500) > 0.5,
        "c64": torch.randn(90, dtype=torch.complex64), "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4), "noncontig": torch.randn(20, 30).t(),
        "np": np.arange(120, dtype=np.uint32).reshape(10, 12),
    }

    class Holder:
        def __init__(self) -> None:
            self.state: dict[str, object] = {}

        def state_dict(self) -> dict[str, object]:
            return dict(values)

        def load_state_dict(self, s: dict[str, object]) -> None:
            self.state = s

    with SnapshotManager("p", job="dt", store=tmp_path / "s") as m:
        m.save(0, holder=Holder())
        h = Holder()
        assert m.restore(holder=h) == 0
    for k, v in values.items():
        got = h.state[k]
        if isinstance(v, np.ndarray):
            assert isinstance(got, np.ndarray) and got.dtype == v.dtype
            assert np.array_equal(got, v)
        else:
            assert isinstance(got, torch.Tensor)
            assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k


def test_prefixed_keys_are_matched() -> None:
    model, _, _, _ = make()
    sd = model.state_dict()
    compiled = {"_orig_mod." + k: v for k, v in sd.items()}
    ddp = {"module." + k: v for k, v in sd.items()}
    assert set(match_model_state(compiled, sd)) == set(sd)
    assert set(match_model_state(ddp, sd)) == set(sd)
    target = {"module._orig_mod." + k: v for k, v in sd.items()}
    assert set(match_model_state(sd, target)) == set(target)


def test_compiled_model_snapshot_restores_into_plain_model(tmp_path: Path) -> None:
    model, opt, sched, _ = make()
    train(model, opt, sched, 2)

    class Wrapped(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

    with SnapshotManager("p", job="pre", store=tmp_path / "s") as m:
        m.save(2, Wrapped(model))
        plain, _, _, _ = make(seed=5)
        m.restore(plain)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, model.state_dict()[k])


def test_other_model_lists_differing_keys(tmp_path: Path) -> None:
    model, opt, _, _ = make()
    with SnapshotManager("p", job="mm", store=tmp_path / "s") as m:
        m.save(1, model, opt)
        other = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3),
                              nn.Linear(3, 1))
        before = {k: v.clone() for k, v in other.state_dict().items()}
        with pytest.raises(StateMismatch) as e:
            m.restore(other)
        msg = str(e.value)
        assert "3.weight" in msg and "3.bias" in msg  # missing from the snapshot
        assert "2.weight: snapshot torch.float32 (2, 16), model torch.float32 (3, 16)" in msg
        # nothing was loaded
        for k, v in other.state_dict().items():
            assert torch.equal(v, before[k])


def test_optimizer_mismatch_is_explained(tmp_path: Path) -> None:
    model, opt, sched, _ = make()
    train(model, opt, sched, 1)
    with SnapshotManager("p", job="om", store=tmp_path / "s") as m:
        m.save(1, model, opt)
        model2, _, _, _ = make()
        opt2 = torch.optim.AdamW([{"params": list(model2.parameters())[:2]},
                                  {"params": list(model2.parameters())[2:]}])
        with pytest.raises(StateMismatch, match=r"2 parameter groups|1 parameter groups"):
            m.restore(model2, opt2)

"""What a snapshot holds comes back as it was: NumPy scalars keep their types, dict keys of
equal text are refused, a module that keeps the tensor a restore gives it keeps no staging
buffer, and a restore an extra refuses leaves the model untouched (each failed before its
fix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ciuic import SnapshotManager, StateHolder, StateMismatch
from ciuic.errors import CaptureError
from ciuic.format import tree
from tests.models import model_opt


def test_numpy_scalars_as_metrics_and_state_round_trip(store_dir: Path) -> None:
    class Holder:
        def __init__(self) -> None:
            self.s: dict[str, object] = {"best": np.float64(0.5), "f32": np.float32(0.1),
                                         "n": np.int16(-3), "flag": np.bool_(True)}

        def state_dict(self) -> dict[str, object]:
            return self.s

        def load_state_dict(self, s: dict[str, object]) -> None:
            self.s = s

    model, opt = model_opt(8, 4)
    with SnapshotManager("p", job="np", store=store_dir, keep_last=1, save_interval=1) as m:
        assert m.step(0, model, opt, holder=Holder(), loss=np.float64(0.25))
        assert m.step(1, model, opt, holder=Holder(), loss=np.float32(0.125))
        m.wait()
        assert m.stats.failures == 0
        assert m.latest().metrics == {"loss": 0.125}  # type: ignore[union-attr]
    h = Holder()
    h.s = {}
    with SnapshotManager("p", job="np", store=store_dir) as m2:
        assert m2.restore(model, opt, holder=h) == 1
    assert h.s["f32"] == np.float32(0.1) and type(h.s["f32"]) is np.float32
    assert type(h.s["best"]) is np.float64 and type(h.s["n"]) is np.int16
    assert h.s["flag"] == np.bool_(True)

def test_failed_extra_leaves_model_untouched(store_dir: Path) -> None:
    from ciuic import ResumableSampler

    model, opt = model_opt(8, 4)
    with SnapshotManager("p", job="ex", store=store_dir) as m:
        m.save(0, model, opt, sampler=ResumableSampler(10), cfg=5)
    other, opt2 = model_opt(8, 4)
    with torch.no_grad():
        other.weight.fill_(7.0)
    with SnapshotManager("p", job="ex", store=store_dir) as m2:
        with pytest.raises(Exception, match="no load_state_dict"):
            m2.restore(other, opt2, cfg=5)
        with pytest.raises(StateMismatch, match=r"sampler.load_state_dict\(\) rejected"):
            m2.restore(other, opt2, sampler=ResumableSampler(11))
    assert torch.all(other.weight == 7.0)

def test_dict_keys_of_equal_text_are_refused_and_old_bodies_with_them_restore(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """{0: a, "0": b} named two tensors "0": they shared a staging buffer (the snapshot held b
    twice) and a reader buffer (a restore gave b twice)."""
    a, b = torch.full((1000,), 1.0), torch.full((1000,), 2.0)
    with SnapshotManager("p", job="keys", store=store_dir, compression="off") as m:
        with pytest.raises(CaptureError, match=r"keys 0 and '0' of one dict have the same text"):
            m.save(1, s=StateHolder({0: a, "0": b}))
        assert m.latest() is None  # nothing was written
    # a body an earlier version wrote (synchronously, so with the right bytes) still restores
    monkeypatch.setattr(tree, "_check_distinct", lambda *_: None)
    with SnapshotManager("p", job="keys", store=store_dir, compression="off",
                         asynchronous=False) as m:
        m.save(1, s=StateHolder({0: a, "0": b}))
    for asynchronous in (True, False):  # async restores lend staging buffers (model only)
        with SnapshotManager("p", job="keys", store=store_dir,
                             asynchronous=asynchronous) as m:
            h = StateHolder()
            m.restore(s=h)
        assert torch.equal(h.state[0], a) and torch.equal(h.state["0"], b)

class KeepsExtraState(nn.Module):
    """A module whose ``set_extra_state`` keeps the tensor it is given (allowed by torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = torch.zeros(4096)

    def get_extra_state(self) -> torch.Tensor:
        return self.table

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.table = state

def test_a_restored_tensor_the_model_keeps_is_never_the_staging_buffer(store_dir: Path) -> None:
    """A restore reads the model into the staging buffers; a module that keeps the tensor then
    holds a staging buffer: the next snapshots compared the buffer with itself ("unchanged")
    and kept the old digests for new bytes."""
    kw: dict[str, Any] = {"store": store_dir, "compression": "off", "save_interval": None}
    first = KeepsExtraState()
    first.table.fill_(1.0)
    with SnapshotManager("p", job="keep", **kw) as m:
        m.save(1, first)
    model = KeepsExtraState()
    with SnapshotManager("p", job="keep", **kw) as m:
        m.restore(model)
        for step in (2, 3, 4):
            model.table.fill_(float(step))
            m.save(step, model)
            assert not any(buf.data_ptr() == model.table.data_ptr()
                           for buf in m._pipeline.staging._buffers.values())
        snapshots = m.repo.catalog.snapshots("p", "keep")
    assert len(snapshots) == 4
    for info in snapshots:
        fresh = KeepsExtraState()
        with SnapshotManager("p", job="keep", **kw) as m:
            m.restore(fresh, snapshot=info.id)
        assert float(fresh.table[0]) == float(info.step), info.step

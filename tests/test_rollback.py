"""A restore in the process that wrote the snapshots (a rollback: ``restore()`` again, as
``restore(snapshot="healthy")`` after a loss spike does) takes every chunk its staging buffers
still hold from memory, each checked against its digest, and reads only the rest from the
store (docs/architecture.md, "Rollback")."""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from ciuic import SnapshotManager, knobs
from tests import models


def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out |= {f"opt/{i}/{k}": v.clone() for k, v in st.items()}
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    opt.zero_grad()


def read_line(log: str) -> tuple[float, float]:
    """MiB from memory and from the store, as the recovery log's last "Read" line says."""
    found = re.findall(r"Read ([\d.]+ [MG]iB|0 B) from host memory and ([\d.]+ [MG]iB|0 B) "
                       r"from the store", log)
    assert found, log

    def mib(s: str) -> float:
        n, unit = s.split()
        return 0.0 if unit == "B" else float(n) * (1024 if unit == "GiB" else 1)

    return mib(found[-1][0]), mib(found[-1][1])


@pytest.fixture(autouse=True)
def small_chunks() -> object:
    with knobs.override(chunk_bytes=64 * 1024):  # several chunks per tensor
        yield


def test_a_rollback_to_the_latest_snapshot_reads_nothing_from_the_store(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = models.model_opt_stepped(256, 256, 256, batch=4, optimizer=torch.optim.Adam)
    with SnapshotManager("p", job="j", store=store_dir, handle_signals=False) as m:
        m.save(1, model, opt)
        saved = state(model, opt)
        train(model, opt)
        assert not same(state(model, opt), saved)
        with caplog.at_level(logging.INFO, logger="ciuic"):
            assert m.restore(model, opt) == 1
        assert same(state(model, opt), saved)
        assert "Loading snapshot from host memory (this process's staging buffers hold" \
            in caplog.text
        memory, store = read_line(caplog.text)
        assert memory > 1.0 and store == 0.0
        train(model, opt)  # the chain goes on from the rollback
        assert m.save(2, model, opt).parent == m.restored.id  # type: ignore[union-attr]


def test_a_rollback_to_an_older_snapshot_reads_only_what_changed_since(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = models.model_opt_stepped(256, 256, 256, batch=4, optimizer=torch.optim.Adam)
    with SnapshotManager("p", job="j", store=store_dir, handle_signals=False) as m:
        first = m.save(1, model, opt)
        saved = state(model, opt)
        with torch.no_grad():
            model[0].weight.add_(1.0)  # one tensor of seven changes
        m.save(2, model, opt)
        with caplog.at_level(logging.INFO, logger="ciuic"):
            assert m.restore(model, opt, snapshot=first.id) == 1
        assert same(state(model, opt), saved)
        memory, store = read_line(caplog.text)
        weight = 256 * 256 * 4 / 2**20
        assert store == pytest.approx(weight, abs=0.01) and memory > 2 * weight


def test_staged_bytes_that_changed_in_memory_are_read_from_the_store(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = models.model_opt_stepped(256, 256, 256, batch=4, optimizer=torch.optim.Adam)
    with SnapshotManager("p", job="j", store=store_dir, handle_signals=False) as m:
        m.save(1, model, opt)
        saved = state(model, opt)
        for buf in m._pipeline.staging.buffers().values():  # memory that went bad
            if buf.numel() > 100_000:
                buf[70_000:70_100] ^= 0xFF
        train(model, opt)
        with caplog.at_level(logging.INFO, logger="ciuic"):
            assert m.restore(model, opt) == 1
        assert same(state(model, opt), saved)  # bit-exact all the same
        memory, store = read_line(caplog.text)
        assert store > 0.0 and memory > 0.0


def test_a_synchronous_manager_has_no_staging_to_read_from(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = models.model_opt_stepped(256, 256, batch=4, optimizer=torch.optim.Adam)
    with SnapshotManager("p", job="j", store=store_dir, handle_signals=False,
                         asynchronous=False) as m:
        m.save(1, model, opt)
        saved = state(model, opt)
        train(model, opt)
        with caplog.at_level(logging.INFO, logger="ciuic"):
            assert m.restore(model, opt) == 1
        assert same(state(model, opt), saved)
        assert "host memory" not in caplog.text


def test_the_first_snapshot_after_a_restore_finds_its_buffers_allocated(
        store_dir: Path) -> None:
    model, opt = models.model_opt_stepped(256, 256, 256, batch=4, optimizer=torch.optim.Adam)
    sizes = {k: v.numel() * v.element_size() for k, v in state(model, opt).items()}
    with SnapshotManager("p", job="j", store=store_dir, handle_signals=False) as m:
        assert m.restore(model, opt) is None  # nothing to restore: a fresh start
        m.wait()  # the buffers are allocated in the background
        held = Counter(b.numel() for b in m._pipeline.staging.buffers().values())
        assert Counter(sizes.values()) - held == Counter()  # a buffer for every tensor

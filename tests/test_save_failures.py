"""A save that fails or is interrupted: an unexpected error never stops training, and a Ctrl-C
during a snapshot is logged as an interruption, not as a failure training continues after
(each failed before its fix)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ciuic import SnapshotManager
from ciuic.manager import pipeline as snapshot_module
from tests.models import model_opt


def test_unexpected_errors_in_a_save_never_stop_training(store_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    model, opt = model_opt(8, 4)

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("surprise")

    for asynchronous in (False, True):
        with SnapshotManager("p", job=f"rt{asynchronous}", store=store_dir, save_interval=1,
                             asynchronous=asynchronous) as m:
            assert m.step(0, model, opt, conj=torch.randn(3, dtype=torch.complex64).conj())
            m.wait()
            assert m.stats.failures == 0
            with monkeypatch.context() as mp, caplog.at_level(logging.ERROR, logger="ciuic"):
                mp.setattr(snapshot_module, "write_snapshot", boom)
                started = m.step(1, model, opt)
                m.wait()
            assert started is asynchronous  # async: started, then failed in the background
            assert "surprise" in caplog.text and m.stats.failures == 1

def test_an_interrupted_snapshot_is_logged_as_interrupted(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A second Ctrl-C during a snapshot logged "failed (); training continues" and then the
    process stopped."""
    model, opt = model_opt(8, 4)
    with SnapshotManager("p", job="int", store=store_dir) as m:
        m.save(1, model, opt)

        def interrupt(*_: object, **__: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(snapshot_module, "write_snapshot", interrupt)
        with caplog.at_level(logging.WARNING, "ciuic"), pytest.raises(KeyboardInterrupt):
            m.save(2, model, opt)
    text = caplog.text
    assert "snapshot at step 2 interrupted (KeyboardInterrupt); the latest snapshot is step 1" \
        in text and "training continues" not in text
    assert m.stats.last_error == "KeyboardInterrupt"

"""``ciuic diff A B``: what changed between two snapshots, reading only what it must."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from ciuic import SnapshotManager
from ciuic.chain.repo import Repository
from ciuic.restore.diff import diff
from tests.models import linear
from tests.test_cli import ciuic

model = partial(linear, 64, 64, 4)


def test_changed_unchanged_nan_values_and_metrics(store_dir: Path) -> None:
    net = model()
    with SnapshotManager("p", job="a", store=store_dir, handle_signals=False) as m:
        m.save(1, net, epoch=1, loss=2.5, cfg={"lr": 0.1, "name": "x"})
        with torch.no_grad():
            net[1].weight.add_(1.0)  # net[0] is left alone: stored as the same chunks
            net[1].bias[0] = float("nan")
        m.save(2, net, epoch=2, loss=2.0, cfg={"lr": 0.05, "name": "x"})
    with Repository.open(store_dir) as repo:
        a, b = repo.resolve("p/a@1"), repo.resolve("p/a@2")
        d = diff(repo, a, repo, b)
    by = {t.path: t for t in d.tensors}
    assert by["model/0.weight"].status == "unchanged" and not by["model/0.weight"].read
    w = by["model/1.weight"]
    assert w.status == "changed" and w.read and w.changed_elements == 256
    assert w.max_abs_diff == pytest.approx(1.0, abs=1e-6) and w.rel_norm_change > 0
    bias = by["model/1.bias"]
    assert (bias.nonfinite_a, bias.nonfinite_b) == (0, 1)  # the NaN that appeared
    assert d.bytes_read < 2 * 64 * 64 * 4  # the unchanged 16 KiB weight was not read
    assert {v.path: (v.a, v.b) for v in d.values} == {"epoch": (1, 2), "loss": (2.5, 2.0),
                                                      "cfg/lr": (0.1, 0.05)}
    assert {v.path: (v.a, v.b) for v in d.metrics} == {"epoch": (1, 2), "loss": (2.5, 2.0)}


def test_diff_json_is_strict_json_where_a_value_is_nan(store_dir: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`ciuic diff --json` printed a bare NaN (the bias that became NaN), which JSON parsers
    refuse; it is null now, as in the server's answer, with the NaN counted."""
    net = model()
    with SnapshotManager("p", job="a", store=store_dir, handle_signals=False) as m:
        m.save(1, net, loss=2.5)
        with torch.no_grad():
            net[1].bias[0] = float("nan")
        m.save(2, net, loss=float("inf"))
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "diff", "p/a@1",
                           "p/a@2", "--json")
    assert code == 0, err

    def refuse(word: str) -> None:
        raise AssertionError(f"{word} in the JSON")

    got = json.loads(out, parse_constant=refuse)
    bias = {t["path"]: t for t in got["tensors"]}["model/1.bias"]
    assert bias["max_abs_diff"] is None and bias["nonfinite_b"] == 1
    assert {v["path"]: v["b"] for v in got["metrics"]} == {"loss": None}


def test_across_two_jobs_with_added_removed_and_reshaped_tensors(store_dir: Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    with SnapshotManager("p", job="a", store=store_dir, handle_signals=False) as m:
        m.save(1, {"x": torch.zeros(3), "gone": torch.ones(2), "int": torch.arange(4)})
    with SnapshotManager("p", job="b", store=store_dir, handle_signals=False) as m:
        m.save(5, {"x": torch.zeros(4), "new": torch.ones(2), "int": torch.arange(4) * 2})
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "diff", "p/a@1",
                           "p/b@5", "--json")
    assert code == 0, err
    got = {t["path"]: t for t in json.loads(out)["tensors"]}
    assert got["model/gone"]["status"] == "removed" and got["model/new"]["status"] == "added"
    assert got["model/x"]["status"] == "changed" and "[3] -> " in got["model/x"]["note"]
    assert got["model/int"]["changed_elements"] == 3 and got["model/int"]["max_abs_diff"] == 3
    code, out, _ = ciuic(capsys, monkeypatch, "--store", str(store_dir), "diff", "p/a@1",
                         "p/b@5")
    assert code == 0 and "1 added, 1 removed" in out and "model/gone" in out


def test_a_snapshot_against_itself_reads_nothing(store_dir: Path) -> None:
    with SnapshotManager("p", job="a", store=store_dir, handle_signals=False) as m:
        m.save(1, model())
    with Repository.open(store_dir) as repo:
        info = repo.resolve("p/a@1")
        d = diff(repo, info, repo, info)
    assert d.bytes_read == 0 and not d.values and not d.metrics
    assert {t.status for t in d.tensors} == {"unchanged"}


def test_a_metric_that_became_nan_or_inf_is_shown_as_such(store_dir: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Issue 30: `metrics changed: loss: 1.0 -> None` where the loss became NaN (the values
    above it said `-> nan`): the catalog keeps NaN and Inf as null; the manifest keeps them."""
    with SnapshotManager("p", job="a", store=store_dir, handle_signals=False) as m:
        m.save(1, model(), loss=1.0, grad_norm=2.0)
        m.save(2, model(), loss=float("nan"), grad_norm=float("inf"))
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "diff", "p/a@1",
                           "p/a@2")
    assert code == 0, err
    metrics = out.split("metrics changed")[1]
    assert "loss: 1.0 -> nan" in metrics and "grad_norm: 2.0 -> inf" in metrics, out
    assert "None" not in out

"""Snapshot health: statistics recorded while writing, the verdict in the manifest, ``@healthy``,
``restore(snapshot="healthy")``, retention, ``ciuic log`` and ``ciuic inspect``."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ciuic import HealthPolicy, SnapshotManager, StateHolder, knobs
from ciuic.chain.health import judge, robust_z
from ciuic.chain.read import read_body
from ciuic.chain.repo import Repository
from ciuic.errors import ConfigurationError, SnapshotNotFound
from ciuic.format import manifest as mf
from ciuic.format import stats as st
from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.shards import Written, assemble
from ciuic.format.tree import Leaf, walk_leaves
from ciuic.restore import inspect
from ciuic.restore.diff import diff
from tests.models import model_opt
from tests.test_cli import ciuic


def _expect(t: torch.Tensor) -> dict[str, float | int]:
    f = t.detach().to(torch.float64).reshape(-1)
    fin = f[torch.isfinite(f)]
    return {"nan": int(torch.isnan(f).sum()), "inf": int(torch.isinf(f).sum()),
            "min": float(fin.min()), "max": float(fin.max()), "mean": float(fin.mean()),
            "norm": float(fin.norm())}


def _check(s: st.Stats | None, t: torch.Tensor) -> None:
    assert s is not None
    e = _expect(t)
    assert (s.nan, s.inf) == (e["nan"], e["inf"])
    assert s.lo == pytest.approx(e["min"], rel=1e-6) and s.hi == pytest.approx(e["max"], rel=1e-6)
    assert s.mean == pytest.approx(e["mean"], rel=1e-3, abs=1e-6)
    assert s.norm == pytest.approx(e["norm"], rel=1e-3)


def test_statistics_are_recorded_piece_by_piece_for_every_float_dtype(store_dir: Path) -> None:
    torch.manual_seed(0)
    big = torch.randn(3000)  # 12000 bytes: 12 pieces of 1 KiB, the last one short
    big[17], big[2500], big[2999] = float("nan"), float("inf"), float("-inf")
    state = {"big": big, "half": torch.randn(700).half(), "bf": torch.randn(900).bfloat16(),
             "f64": torch.randn(400, dtype=torch.float64), "small": torch.tensor([1.5, -2.0]),
             "ints": torch.arange(1000), "np": np.linspace(-1, 3, 500, dtype=np.float32),
             "allnan": torch.full((300,), float("nan"))}
    with knobs.override(chunk_bytes=1024), SnapshotManager(
            "p", store=store_dir, handle_signals=False) as m:
        m.save(1, state)
    with Repository.open(store_dir) as repo:
        _, states = read_body(repo, repo.resolve("p/default@1"))
        rows = {r.path: r for r in inspect.tensors(repo, repo.resolve("p/default@1"))}
    descs = {p: d for p, _k, d in walk_leaves(states)}
    assert len(descs["model/big"]["chunks"]) == 12
    for name in ("big", "half", "bf", "f64", "small"):
        _check(st.of_descriptor(descs[f"model/{name}"]), state[name])
    _check(st.of_descriptor(descs["model/np"]), torch.from_numpy(state["np"]))
    assert "stats" not in descs["model/ints"] and rows["model/ints"].stats is None
    nan_only = st.of_descriptor(descs["model/allnan"])
    assert nan_only is not None and nan_only.nan == 300 and nan_only.lo is None
    assert not any(r.computed for r in rows.values())


@pytest.mark.parametrize("case", ["f32", "f64", "bf16", "f16", "np16", "f8", "strided", "huge",
                                  "inf"])
def test_statistics_of_a_piece_agree_with_a_float64_reduction(case: str) -> None:
    """Every kind of piece the writer reduces: NumPy's float32/float64 path, the 16-bit floats
    widened (bfloat16 by its bits), float8 (torch's path), a non-contiguous view, values whose
    squares overflow float32 (reduced again in float64) and a piece holding Inf."""
    torch.manual_seed(1)
    x = torch.randn(1 << 20) * 3 + 0.5
    if case == "huge":
        x = x * 1e20  # the sum of squares overflows float32: the float64 path
    if case == "inf":
        x[5] = float("inf")
    value: torch.Tensor | np.ndarray = {
        "f64": x.double(), "bf16": x.bfloat16(), "f16": x.half(), "np16": x.half().numpy(),
        "f8": x.to(torch.float8_e4m3fn), "strided": x[::2]}.get(case, x)
    _check(st.compute(value), torch.as_tensor(value))


def test_a_snapshot_of_unchanged_pieces_does_not_reduce_them_again(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    net = nn.Linear(256, 64)
    calls: list[int] = []
    real = st.compute

    def counting(flat: torch.Tensor | np.ndarray) -> st.Stats:
        calls.append(int(flat.shape[0]))
        return real(flat)

    monkeypatch.setattr(st, "compute", counting)
    with knobs.override(chunk_bytes=4096), SnapshotManager(
            "p", store=store_dir, handle_signals=False) as m:
        m.save(1, net)
        first = len(calls)
        with torch.no_grad():
            net.bias.add_(1.0)  # the weight's 16 pieces stay as they were
        m.save(2, net)
    assert first == 16 + 1  # the weight's pieces, the bias (one piece)
    assert len(calls) - first == 1  # only the changed bias again
    with Repository.open(store_dir) as repo:
        rows = {r.path: r for r in inspect.tensors(repo, repo.resolve("p/default@2"))}
    _check(rows["model/weight"].stats, net.weight)
    _check(rows["model/bias"].stats, net.bias)


def test_sharded_descriptors_combine_their_shards_statistics() -> None:
    whole = torch.randn(10, 4)
    whole[7, 1] = float("nan")
    leaf = Leaf("model/w", whole, {}, shard=([10, 4], [0, 0]))
    written = []
    for off, part in ((0, whole[:6]), (6, whole[6:])):
        s = st.compute(part.reshape(-1))
        written.append(Written("model/w", [off, 0], TensorDescriptor(
            dtype="float32", shape=tuple(part.shape), nbytes=part.numel() * 4, inline="",
            stats=s.to_json())))
    assemble([leaf], written)
    assert all("stats" in s for s in leaf.descriptor["shards"])  # type: ignore[union-attr]
    _check(st.of_descriptor(leaf.descriptor), whole)


def _train_to_nan(store_dir: Path, keep_last: int | None = None) -> nn.Module:
    """Ten snapshots; from step 60 on, one weight holds NaN (a loss explosion)."""
    net, opt = model_opt(8, 16, 1, lr=0.01)
    with SnapshotManager("p", job="j", store=store_dir, save_interval=10, keep_last=keep_last,
                         handle_signals=False) as m:
        for step in range(1, 101):
            opt.zero_grad()
            loss = net(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            if step == 55:
                with torch.no_grad():
                    net[1].weight[0, 3] = float("nan")
            m.step(step, net, opt, loss=loss.item())
    return net


def test_a_job_whose_weights_turn_nan(store_dir: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _train_to_nan(store_dir)
    with Repository.open(store_dir) as repo:
        snaps = repo.catalog.snapshots("p", "j")
        assert [s.healthy for s in snaps] == [True] * 5 + [False] * 5
        sick = snaps[5]
        assert "model/1.weight: 16 NaN of 16 elements" in sick.health.reasons  # type: ignore[union-attr]
        assert sick.health.nonfinite >= 1  # type: ignore[union-attr,operator]
        assert repo.resolve("p/j@healthy").step == 50
        m = repo.read_manifest("p", "j", sick.id)
        assert m.format == mf.HEALTH_FORMAT and m.healthy is False
        d = diff(repo, repo.resolve("p/j@healthy"), repo, repo.resolve("p/j@latest"))
    by = {t.path: t for t in d.tensors}
    assert (by["model/1.weight"].nonfinite_a, by["model/1.weight"].nonfinite_b) == (0, 16)

    fresh = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    with SnapshotManager("p", job="j", store=store_dir, handle_signals=False) as m:
        assert m.restore(fresh, snapshot="healthy") == 50
    assert torch.isfinite(fresh[1].weight).all()

    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "log", "p/j")
    assert code == 0, err
    lines = {ln.split()[1]: ln for ln in out.splitlines()
             if len(ln.split()) > 1 and ln.split()[1].isdigit()}
    assert "unhealthy" in lines["60"] and "model/0.weight: 128 NaN" in lines["60"]
    assert " ok " in lines["50"] and "loss=nan" in lines["60"]
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "diff",
                           "p/j@healthy", "p/j@latest")
    assert code == 0, err
    assert "model/1.weight" in out and "NaN/Inf appeared" in out
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "show",
                           "p/j@healthy")
    assert code == 0, err
    assert "step     50" in out and "health   healthy" in out
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "show",
                           "p/j@latest")
    assert code == 0, err
    assert "health   unhealthy: model/0.weight: 128 NaN" in out


def test_retention_keeps_the_newest_healthy_snapshot(store_dir: Path) -> None:
    _train_to_nan(store_dir, keep_last=2)
    with Repository.open(store_dir) as repo:
        kept = {s.step: s.healthy for s in repo.catalog.snapshots("p", "j")}
    assert kept == {50: True, 90: False, 100: False}


def test_a_loss_spike_marks_a_snapshot_and_the_threshold_is_the_users(store_dir: Path) -> None:
    losses = [2.0, 1.95, 1.97, 1.9, 1.92, 1.88, 1.9, 1.86, 9.5, 1.85, 1.84]
    for job, policy in (("default", HealthPolicy()), ("lax", HealthPolicy(loss_zscore=1e6))):
        with SnapshotManager("p", job=job, store=store_dir, handle_signals=False,
                             health=policy) as m:
            for step, loss in enumerate(losses):
                m.save(step, {"w": torch.ones(4)}, loss=loss)
    with Repository.open(store_dir) as repo:
        strict = repo.catalog.snapshots("p", "default")
        lax = repo.catalog.snapshots("p", "lax")
    assert [s.step for s in strict if not s.healthy] == [8]
    assert "spikes: robust z-score" in strict[8].health.reasons[0]  # type: ignore[union-attr]
    assert all(s.healthy for s in lax)
    with pytest.raises(ConfigurationError, match="loss_zscore"):
        HealthPolicy(loss_zscore=0)
    with pytest.raises(ConfigurationError, match="health must be"):
        SnapshotManager("p", store=store_dir, health="yes")  # type: ignore[arg-type]


def test_a_norm_jump_and_a_non_finite_loss_mark_a_snapshot() -> None:
    w = st.compute(torch.ones(100))
    ok = judge({"model/w": w}, {"loss": 1.0}, [1.0] * 10, {"model/w": 10.0}, HealthPolicy())
    assert ok.healthy and ok.norms == {"model": "10.0"}
    big = st.compute(torch.full((100,), 30.0))  # norm 300: 30x
    jump = judge({"model/w": big, "optimizer/state/0/exp_avg_sq": big}, {}, [],
                 {"model/w": 10.0, "optimizer/state/0/exp_avg_sq": 10.0}, HealthPolicy())
    assert not jump.healthy and len(jump.reasons) == 1  # the optimizer's is not watched
    assert "model/w: norm jumped 30.0x" in jump.reasons[0]
    assert judge({"model/w": big}, {}, [], {"model/w": 10.0},
                 HealthPolicy(norm_jump=None)).healthy
    nan_loss = judge({}, {"loss": math.nan}, [], None, HealthPolicy())
    assert nan_loss.reasons == ("loss is nan",)
    assert robust_z(5.0, [1.0, 1.0, 1.0]) == pytest.approx(400.0)  # a flat history judges
    assert robust_z(1.01, [1.0] * 10) == pytest.approx(1.0)  # a 1 % rise is no spike


def test_older_snapshots_without_statistics_still_load_diff_and_inspect(
        store_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    net = nn.Linear(32, 8)
    with SnapshotManager("p", store=store_dir, handle_signals=False, health=False) as m:
        m.save(1, net)  # as ciuic wrote it before health: format-1 manifest, no statistics
    with Repository.open(store_dir) as repo:
        old = repo.resolve("p/default@1")
        assert repo.read_manifest("p", "default", old.id).format == mf.FORMAT_VERSION
        assert old.healthy is None
        with pytest.raises(SnapshotNotFound, match=r"not judged \(written before ciuic recorded"):
            repo.resolve("p/default@healthy")
        rows = {r.path: r for r in inspect.tensors(repo, old)}
        assert rows["model/weight"].stats is None
        rows = {r.path: r for r in inspect.tensors(repo, old, compute=True)}
        assert rows["model/weight"].computed
        _check(rows["model/weight"].stats, net.weight)
    with torch.no_grad():
        net.weight.mul_(2.0)
    with SnapshotManager("p", store=store_dir, handle_signals=False) as m:
        assert m.restore(nn.Linear(32, 8)) == 1
        m.save(2, net)
    with Repository.open(store_dir) as repo:
        new = repo.resolve("p/default@2")
        assert new.healthy is True
        d = diff(repo, repo.resolve("p/default@1"), repo, new)
    w = {t.path: t for t in d.tensors}["model/weight"]
    assert w.status == "changed" and w.rel_norm_change == pytest.approx(1.0)
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "inspect",
                           "p/default@1")
    assert code == 0, err
    assert "health not recorded" in out and "computed now" in out


def test_inspect_shows_statistics_and_a_histogram(store_dir: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    values = torch.cat([torch.zeros(900), torch.ones(100)])
    values[0] = float("nan")
    with SnapshotManager("p", store=store_dir, handle_signals=False) as m:
        m.save(3, {"w": values})
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "inspect",
                           "p/default@3", "model/w", "--bins", "4", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["counts"] == [899, 0, 0, 100] and got["edges"][0] == 0.0
    assert got["tensor"]["stats"]["nan"] == 1
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "inspect",
                           "p/default@3", "model/w", "--bins", "4")
    assert code == 0, err
    assert "unhealthy" in out and "model/w: 1 NaN of 1000" in out and "█" in out
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "inspect",
                           "p/default@3", "model/nope")
    assert code != 0 and "no tensor 'model/nope'" in (out + err)


def test_chain_series_gives_loss_and_norms_along_the_chain(store_dir: Path) -> None:
    with SnapshotManager("p", store=store_dir, handle_signals=False) as m:
        for step in range(3):
            m.save(step, {"w": torch.full((4,), float(step + 1))}, loss=3.0 - step)
    with Repository.open(store_dir) as repo:
        series = inspect.chain_series(repo, "p", "default")
    assert [p["loss"] for p in series] == [3.0, 2.0, 1.0]
    assert [p["norms"]["model"] for p in series] == [2.0, 4.0, 6.0]
    assert all(p["healthy"] for p in series)


def test_manifest_health_is_checked_when_read() -> None:
    m = mf.Manifest(project="p", job="j", step=1, parent="", created=mf.utc_now(),
                    body="0" * 64, body_bytes=1, total_bytes=1, new_bytes=1, tensors=1,
                    health=mf.HealthVerdict(False, ("x",), nonfinite=1, norms={}))
    data = m.encode()
    assert b'"format":2' in data and b'"health":{"healthy":false' in data
    back = mf.Manifest.decode(data)
    assert back == m and back.healthy is False
    with pytest.raises(Exception, match="health"):
        mf.Manifest.decode(data.replace(b'"healthy":false', b'"healthy":"no"'))
    with pytest.raises(Exception, match="canonical"):  # format 1 holds no health
        mf.Manifest.decode(data.replace(b'"format":2', b'"format":1'))
    # a field a later ciuic adds to the verdict is kept: the manifest re-encodes to its bytes
    later = data.replace(b'"healthy":false', b'"drift":{"score":"0.5"},"healthy":false')
    kept = mf.Manifest.decode(later)
    assert kept.encode() == later and kept.health == mf.HealthVerdict(
        False, ("x",), nonfinite=1, norms={}, extra={"drift": {"score": "0.5"}})
    # an old verdict without counts or norms reads as such, and re-encodes without them
    bare = data.replace(b',"nonfinite":1,"norms":{}', b"")
    assert bare != data and mf.Manifest.decode(bare).health == mf.HealthVerdict(False, ("x",))
    assert mf.Manifest.decode(bare).encode() == bare


def test_a_divergence_that_persists_stays_unhealthy(store_dir: Path) -> None:
    """After a blow-up the later snapshots are judged against the last healthy state, not the
    diverged one: ``@healthy`` never becomes the diverged state."""
    w = torch.ones(1000)
    with SnapshotManager("p", job="norm", store=store_dir, handle_signals=False) as m:
        for step in range(1, 7):
            m.save(step, {"w": w * (1000.0 if step >= 3 else 1.0)}, loss=1.0 - 0.01 * step)
    with SnapshotManager("p", job="norm", store=store_dir, handle_signals=False) as m:
        assert m.restore(StateHolder({"w": torch.zeros(1000)})) == 6  # a new process: rebuilt
        m.save(7, {"w": w * 1000.0}, loss=0.9)
    with SnapshotManager("p", job="loss", store=store_dir, handle_signals=False) as m:
        for step in range(1, 16):
            m.save(step, {"w": w}, loss=50.0 if step >= 8 else 1.0 + 0.01 * (step % 3))
    with Repository.open(store_dir) as repo:
        norm = [s.healthy for s in repo.catalog.snapshots("p", "norm")]
        loss = [s.healthy for s in repo.catalog.snapshots("p", "loss")]
        assert repo.resolve("p/norm@healthy").step == 2
        assert repo.resolve("p/loss@healthy").step == 7
    assert norm == [True, True, False, False, False, False, False]
    assert loss == [True] * 7 + [False] * 8


def test_intended_infinities_odd_dtypes_and_16_bit_precision(store_dir: Path) -> None:
    mask = torch.triu(torch.full((8, 8), float("-inf")), diagonal=1)
    policy = HealthPolicy(nonfinite_ignore=("model/mask",))
    with SnapshotManager("p", store=store_dir, handle_signals=False, health=policy) as m:
        m.save(1, {"mask": mask, "w": torch.ones(4)})
        # NumPy's longdouble has no torch counterpart: stored, without statistics
        m.save(2, {"mask": mask, "big": np.ones(5000, np.longdouble),
                   "bf": torch.ones(1_000_000, dtype=torch.bfloat16)})
    with Repository.open(store_dir) as repo:
        assert repo.resolve("p/default@1").healthy is True
        rows = {r.path: r for r in inspect.tensors(repo, repo.resolve("p/default@2"))}
    assert rows["model/mask"].stats is not None and rows["model/mask"].stats.inf == 28
    assert rows["model/big"].stats is None
    bf = rows["model/bf"].stats
    assert bf is not None and bf.mean == 1.0 and bf.norm == 1000.0  # summed in float32
    with pytest.raises(ConfigurationError, match="nonfinite_ignore is a tuple"):
        HealthPolicy(nonfinite_ignore="model/mask")  # type: ignore[arg-type]


def _table(out: str) -> dict[str, list[str]]:
    """The rows of a table ``ciuic`` drew, by their first cell."""
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines()
            if line.startswith("│")]
    return {r[0]: r for r in rows if r and r[0].startswith("model/")}


def test_nan_and_inf_tensors_show_nan_or_nothing_never_a_healthy_number(
        store_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30: an all-NaN tensor showed ``norm 0`` (inspect) and ``max |a-b| 0``, ``norm
    change -100.00%`` (diff); the manifest recorded its norm as "0.0"."""
    nan, inf = float("nan"), float("inf")
    part, infs = torch.ones(8), torch.ones(8)
    part[0], infs[0] = nan, inf
    with SnapshotManager("p", store=store_dir, handle_signals=False) as m:
        m.save(1, {"w": torch.ones(8), "part": torch.ones(8), "inf": torch.ones(8)})
        m.save(2, {"w": torch.full((8,), nan), "part": part, "inf": infs})
    with Repository.open(store_dir) as repo:
        a, b = repo.resolve("p/default@1"), repo.resolve("p/default@2")
        descs = {p: d for p, _k, d in walk_leaves(read_body(repo, b)[1])}
        d = {t.path: t for t in diff(repo, a, repo, b).tensors}
        series = inspect.chain_series(repo, "p", "default")
    assert descs["model/w"]["stats"] == {"inf": 0, "nan": 8}  # no norm of no element
    back = st.of_descriptor(descs["model/w"])
    assert back is not None and back.nan == 8 and back.summary()["norm"] is not None
    assert math.isnan(back.summary()["norm"] or 0.0)
    assert [p["norms"].get("model") for p in series] == [pytest.approx(math.sqrt(24)), None]
    assert math.isnan(d["model/w"].max_abs_diff or 0.0) and d["model/w"].changed_elements == 8
    assert math.isnan(d["model/w"].rel_norm_change or 0.0)
    assert math.isnan(d["model/part"].max_abs_diff or 0.0)
    assert d["model/inf"].max_abs_diff == inf and d["model/inf"].rel_norm_change == inf

    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "inspect",
                           "p/default@2")
    assert code == 0, err
    rows = _table(out)  # tensor, dtype and shape, NaN, Inf, min, max, mean, norm
    assert rows["model/w"][2:] == ["8", "0", "nan", "nan", "nan", "nan"], out
    assert rows["model/part"][2:] == ["1", "0", "nan", "nan", "nan", "nan"], out
    assert rows["model/inf"][2:] == ["0", "1", "-", "-", "-", "inf"], out
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "inspect",
                           "p/default@2", "--json")
    assert code == 0, err
    got = {t["path"]: t["stats"] for t in json.loads(out)["tensors"]}
    assert got["model/w"] == {"nan": 8, "inf": 0, "min": None, "max": None, "mean": None,
                              "norm": None}
    assert got["model/inf"]["norm"] is None and got["model/inf"]["max"] is None
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "diff",
                           "p/default@1", "p/default@2")
    assert code == 0, err
    rows = _table(out)  # tensor, status, max |a-b|, norm change, NaN/Inf, changed, dtype
    assert rows["model/w"][2:6] == ["nan", "nan", "0 -> 8", "8"], out
    assert rows["model/inf"][2:4] == ["inf", "inf"], out


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ciuic" and r.levelno >= logging.WARNING and "health" in r.getMessage()]


def test_an_unhealthy_snapshot_is_one_short_line_and_a_run_that_stays_so_is_not_repeated(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 30: each unhealthy snapshot logged every reason (700 characters), and again at
    every later snapshot of a run that stayed unhealthy for the same reasons."""
    caplog.set_level(logging.INFO, logger="ciuic")
    _train_to_nan(store_dir)  # steps 60 to 100 unhealthy: 4 tensors NaN, the loss NaN
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert "\n" not in warned[0] and len(warned[0]) <= 240, warned[0]
    assert warned[0] == (
        "snapshot at step 60 of p/j is unhealthy: model/0.weight: 128 NaN of 128 elements; "
        "model/0.bias: 16 NaN of 16 elements; and 3 more reasons (`ciuic inspect p/j@60` "
        "lists them all)")


def test_a_run_that_stays_unhealthy_is_warned_of_new_reasons_counted_and_told_when_it_heals(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ciuic")
    nan, one = torch.full((4,), float("nan")), torch.ones(4)
    with SnapshotManager("p", store=store_dir, handle_signals=False) as m:
        for step in range(1, 30):
            m.save(step, {"w": nan if 3 <= step < 28 else one,
                          "v": nan if 8 <= step < 28 else one}, loss=1.0)
    both = "model/w: 4 NaN of 4 elements; model/v: 4 NaN of 4 elements"
    assert _warnings(caplog) == [
        "snapshot at step 3 of p/default is unhealthy: model/w: 4 NaN of 4 elements "
        "(`ciuic inspect p/default@3` shows its tensors)",
        "snapshot at step 8 of p/default is unhealthy for a new reason: model/v: 4 NaN of 4 "
        "elements; model/w: 4 NaN of 4 elements (`ciuic inspect p/default@8` shows its "
        "tensors)",
        "p/default is still unhealthy at step 12, 10 snapshots in a row since step 3: "
        f"{both} (`ciuic inspect p/default@12` shows its tensors)",
        "p/default is still unhealthy at step 22, 20 snapshots in a row since step 3: "
        f"{both} (`ciuic inspect p/default@22` shows its tensors)",
        "snapshot at step 28 of p/default is healthy again, after 25 unhealthy snapshots "
        "(steps 3 to 27)"]


def train_with_adam(manager: SnapshotManager, net: nn.Linear, steps: int,
                    every: int) -> torch.optim.Optimizer:
    """Train ``net`` with Adam (per-parameter float ``step`` tensors) for ``steps`` steps,
    saving a snapshot every ``every``; returns the optimizer."""
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for step in range(1, steps + 1):
        opt.zero_grad()
        net(torch.randn(2, net.in_features)).pow(2).mean().backward()
        opt.step()
        if step % every == 0:
            manager.save(step, net, opt, loss=1.0)
    return opt


def test_the_optimizers_step_counters_are_left_out_of_its_norm(store_dir: Path) -> None:
    """Issue 30: Adam's per-parameter ``step`` tensors (float, the step count) made the
    optimizer's norm on the dashboard's plot (step x sqrt(parameters)), dwarfing its moments."""
    torch.manual_seed(0)
    with SnapshotManager("p", store=store_dir, handle_signals=False) as m:
        opt = train_with_adam(m, nn.Linear(8, 4), 200, 100)
    moments = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    expected = math.sqrt(sum(float(t.double().pow(2).sum()) for t in moments))
    with Repository.open(store_dir) as repo:
        series = inspect.chain_series(repo, "p", "default")
        rows = {r.path: r for r in inspect.tensors(repo, repo.resolve("p/default@200"))}
    assert series[-1]["norms"]["optimizer"] == pytest.approx(expected, rel=1e-5)
    assert rows["optimizer/state/0/step"].stats is not None  # still shown as the tensor it is
    # nor are counters judged for a jump (1 -> 300 would be one); NaN in one still counts
    count = st.compute(torch.tensor([300.0]).reshape(-1))
    before = {"optimizer/state/0/step": 1.0}
    watch = HealthPolicy(norm_states=("model", "optimizer"))
    assert judge({"optimizer/state/0/step": count}, {}, [], before, watch).healthy
    nan = st.compute(torch.tensor([math.nan]))
    assert judge({"optimizer/state/0/step": nan}, {}, [], before, watch).reasons == (
        "optimizer/state/0/step: 1 NaN of 1 element",)

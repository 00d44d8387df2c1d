"""The command line's edges a new user hit (issue 42, item 13): an export of a state with no
tensors, a mistyped destination, Python values in messages, ``--json`` for ``ls`` and ``log``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ciuic import ResumableSampler, SnapshotManager
from ciuic.format import layout
from tests.models import model_opt
from tests.test_cli import ciuic


@pytest.fixture
def store(store_dir: Path) -> Path:
    """proj/job1: snapshots at steps 1 and 2 with a sampler; then a second lineage (a run that
    did not restore) at step 1."""
    model, opt = model_opt(4, 4)
    sampler = ResumableSampler(10)
    with SnapshotManager("proj", job="job1", store=store_dir, handle_signals=False) as m:
        for step in (1, 2):
            m.save(step, model, opt, sampler=sampler, loss=0.5 * step)
    with SnapshotManager("proj", job="job1", store=store_dir, handle_signals=False) as m:
        m.save(1, model, opt, sampler=sampler)
    return store_dir


def test_ls_and_log_print_json(store: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store), "ls", "--json")
    assert code == 0, err
    [row] = json.loads(out)["jobs"]
    assert {k: row[k] for k in ("project", "job", "snapshots", "max_step")} == {
        "project": "proj", "job": "job1", "snapshots": 3, "max_step": 2}
    assert row["new_bytes"] > 0 and row["latest"].endswith("Z")
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store), "log", "proj/job1",
                           "--json")
    assert code == 0, err
    log = json.loads(out)
    assert (log["project"], log["job"]) == ("proj", "job1")
    snaps = log["snapshots"]
    assert [(s["step"], s["lineage"]) for s in snaps] == [(1, 2), (2, 1), (1, 1)]
    assert snaps[1]["metrics"] == {"loss": 1.0} and snaps[1]["parent"] == snaps[2]["id"]
    assert all(isinstance(s["notes"], list) and s["status"] == "committed"
               and s["damaged"] is False for s in snaps)
    code, out, _ = ciuic(capsys, monkeypatch, "--store", str(store / "none"), "ls", "--json")
    assert code != 0  # no store: an error, not an empty list


def test_a_state_without_tensors_is_not_written_as_an_empty_file(
        store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--state sampler` wrote an empty file and said "Wrote 0 tensors"; `--state bogus`
    said "has no state ['bogus']"."""
    to = tmp_path / "s.pt"
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store), "restore",
                           "job1@latest", "--state", "sampler", "--to", str(to))
    assert code == 2 and not to.exists(), out
    assert "the state sampler of snapshot" in err and "holds no tensors" in err
    code, _, err = ciuic(capsys, monkeypatch, "--store", str(store), "restore", "job1@latest",
                         "--state", "bogus", "--state", "nope", "--to", str(to))
    assert code == 2 and "has no states bogus, nope; it has: model, optimizer, rng" in err
    assert "[" not in err and not to.exists()
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store), "restore", "job1@latest",
                           "--state", "rng", "--to", str(to))
    assert code == 0, err
    assert torch.load(to, weights_only=True)  # a state with tensors still exports


@pytest.mark.parametrize("how", ["push", "copy"])
def test_a_destination_that_holds_no_store_needs_create(
        store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """`ciuic push J /nonexistent/x/y` made the whole path and a new store."""
    dest = tmp_path / "nonexistent" / "x" / "y"
    args = (["--store", str(store), "push", "proj/job1", str(dest)] if how == "push" else
            ["copy", str(store), str(dest)])
    code, _, err = ciuic(capsys, monkeypatch, *args)
    assert code == 2 and not (tmp_path / "nonexistent").exists()
    assert f"{dest} does not exist: check the destination, or pass --create" in " ".join(
        err.split())
    (tmp_path / "empty").mkdir()
    code, _, err = ciuic(capsys, monkeypatch, *args[:-1], str(tmp_path / "empty"))
    assert code == 2 and "holds no ciuic store" in err
    assert list((tmp_path / "empty").iterdir()) == []
    code, out, err = ciuic(capsys, monkeypatch, *args, "--create")
    assert code == 0 and "3 new snapshots" in out, err
    code, out, err = ciuic(capsys, monkeypatch, *args)  # a store now: no --create needed
    assert code == 0 and "0 new snapshots" in out, err


def test_verify_names_a_damaged_manifest_without_a_step(
        store: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest that cannot be read has no step: it said "step None"."""
    sid = json.loads(ciuic(capsys, monkeypatch, "--store", str(store), "log", "proj/job1",
                           "--json")[1])["snapshots"][0]["id"]
    (store / "objects" / layout.manifest_key("proj", "job1", sid)).write_bytes(b"{rot")
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store), "verify", "proj/job1")
    assert code != 0
    assert f"  {sid[:12]}: {layout.manifest_key('proj', 'job1', sid)}:" in out, out
    assert "None" not in out + err


def test_push_says_its_progress_with_progress_where_stderr_is_no_terminal(
        store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """push showed no progress: a bar only on a terminal; --progress says it as lines."""
    dest = str(tmp_path / "b")
    code, _, err = ciuic(capsys, monkeypatch, "--store", str(store), "push", "job1", dest,
                         "--create")
    assert code == 0 and "chunks" not in err, err  # not a terminal: silent, as before
    code, _, err = ciuic(capsys, monkeypatch, "--store", str(store), "push", "job1",
                         str(tmp_path / "c"), "--create", "--progress")
    assert code == 0, err
    said = [line for line in err.splitlines() if line.startswith("proj/job1: ")]
    phases = [line.split()[1] for line in said]
    assert "chunks" in phases and "manifests" in phases, err
    last = [line for line in said if line.split()[1] == "chunks"][-1]
    done, count = map(int, last.split()[2].split("/"))
    assert done == count > 0 and "sent)" in last


def test_deep_verify_says_its_progress_with_progress_where_stderr_is_no_terminal(
        store: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """verify --deep showed no progress off a terminal, and none at all while it re-hashed the
    chunks no snapshot names; --progress says both phases as lines."""
    code, _, err = ciuic(capsys, monkeypatch, "--store", str(store), "verify", "--deep")
    assert code == 0 and "snapshots" not in err, err  # not a terminal: silent, as before
    stray = store / "objects" / layout.chunk_key("ab" * 32)  # a chunk no snapshot names
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"not a chunk")
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store), "verify", "--deep",
                           "--progress")
    assert code == 1 and "no readable snapshot names this chunk" in out, out + err
    said = [line for line in err.splitlines() if line.startswith("verify proj/job1: ")]
    last = {line.split(": ")[1].rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in said}
    assert set(last) == {"snapshots", "unreferenced chunks"}, err
    for phase, counts in last.items():
        done, count = map(int, counts.split("/"))
        assert done == count > 0, (phase, err)

"""The command line, end to end on a real store."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ciuic import SnapshotManager, cli
from ciuic.chain.read import chunk_refs, read_body
from ciuic.chain.repo import Repository
from ciuic.format import layout
from ciuic.format.layout import chunk_key
from tests.helpers.stored import flip, stored_at
from tests.models import model_opt


def ciuic(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
          *args: str, columns: int = 200) -> tuple[int, str, str]:
    """``ciuic ARGS`` in this process, its output to a pipe ``columns`` wide."""
    monkeypatch.setattr(sys, "argv", ["ciuic", *args])
    monkeypatch.setenv("COLUMNS", str(columns))
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def populated(store_dir: Path) -> dict[str, object]:
    model, opt = model_opt(300, 300, 10, optimizer=torch.optim.Adam)
    infos = []
    with SnapshotManager("proj", job="job1", store=store_dir) as m:
        for step in (9900, 10000, 10100):
            loss = model(torch.randn(2, 300)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            infos.append(m.save(step, model, opt, loss=loss.item()))
    return {"model": model, "infos": infos, "store": str(store_dir)}


def test_ls_log_show(populated: dict[str, object], capsys: pytest.CaptureFixture[str],
                     monkeypatch: pytest.MonkeyPatch) -> None:
    store = str(populated["store"])
    infos = populated["infos"]
    assert isinstance(infos, list)
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "ls")
    assert code == 0 and "proj/job1" in out and "10100" in out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "log", "proj/job1")
    assert code == 0
    rows = [line for line in out.splitlines() if infos[0].id[:12] in line or
            infos[2].id[:12] in line]
    assert "10100" in rows[0] and "9900" in rows[-1]  # newest first, numeric order
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "show", "job1@10000")
    assert code == 0 and infos[1].id in out and "model/0.weight" in out and "(300, 300)" in out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "show", "--json",
                         infos[2].id[:8])
    assert code == 0 and '"step": 10100' in out
    shown = json.loads(out)  # the manifest and its tensors, as the table shows them
    weight = {t["path"]: t for t in shown["tensor_list"]}["model/0.weight"]
    assert weight["shape"] == [300, 300] and weight["dtype"] == "float32"
    assert weight["nbytes"] == 300 * 300 * 4 and int(weight["stored"]) >= 1  # its chunks


def test_verify_finds_flipped_bit_and_names_object(populated: dict[str, object],
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    store = str(populated["store"])
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "verify", "--deep")
    assert code == 0 and "ok" in out
    infos = populated["infos"]
    assert isinstance(infos, list)
    repo = Repository.open(store)
    _, states = read_body(repo, infos[0])
    ref = sorted(chunk_refs(states).values(), key=lambda r: r.digest)[0]
    key = chunk_key(ref.digest)
    flip(store, ref, 100)
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "verify", "proj/job1")
    assert code == 0  # shallow: the object exists
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "verify", "--deep", "proj/job1")
    assert code == 1
    assert key in out and "does not match its name" in out and infos[0].id[:12] in out


def test_verify_detects_broken_chain(populated: dict[str, object],
                                     capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    store = str(populated["store"])
    infos = populated["infos"]
    assert isinstance(infos, list)
    (Path(store) / "objects" / layout.manifest_key("proj", "job1", infos[1].id)).unlink()
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "verify", "proj/job1")
    assert code == 1 and "the chain is broken" in out


def test_restore_to_safetensors_and_torch(populated: dict[str, object], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    store = str(populated["store"])
    model = populated["model"]
    assert isinstance(model, nn.Module)
    st = tmp_path / "out.safetensors"
    code, _, err = ciuic(capsys, monkeypatch, "--store", store, "restore", "job1@latest",
                         "--to", str(st))
    assert code == 0, err
    loaded = load_file(str(st))
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v)
    pt = tmp_path / "all.pt"
    code, _out, err = ciuic(capsys, monkeypatch, "--store", store, "restore", "job1@latest",
                           "--to", str(pt), "--state", "model", "--state", "optimizer")
    assert code == 0, err
    tensors = torch.load(pt, weights_only=True)
    assert torch.equal(tensors["model/0.weight"], model.state_dict()["0.weight"])
    assert "optimizer/state/0/exp_avg" in tensors


def test_prune_gc_reindex(populated: dict[str, object], capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    store = str(populated["store"])
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "prune", "proj/job1",
                         "--keep-last", "1", "--dry-run")
    assert code == 0 and "would prune 2 snapshots: steps 9900, 10000" in out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "prune", "proj/job1",
                         "--keep-last", "1")
    assert code == 0 and "pruned 2" in out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "gc")
    assert code == 0 and "deleted" in out
    deleted = int(out.split("deleted ")[1].split()[0])
    assert deleted > 0
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "verify", "--deep")
    assert code == 0, out  # pruned snapshots keep the chain verifiable
    (Path(store) / "catalog.db").unlink()
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "reindex")
    assert code == 0 and "indexed 1 snapshot and 2 pruned" in out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "log", "proj/job1", "--all")
    assert out.count("pruned") == 2


def test_a_damaged_pruned_manifest_has_advice_that_works(
        populated: dict[str, object], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42: verify advised `ciuic prune J --snapshot ID` for a pruned snapshot's damaged
    manifest, which answered "no snapshot ID starts with ..."; gc refused for good. gc now
    collects and warns at every run; verify advises `ciuic gc --quarantine`, which works: after
    it, gc and verify are clean."""
    store = str(populated["store"])
    first = populated["infos"][0]  # type: ignore[index]
    assert ciuic(capsys, monkeypatch, "--store", store, "prune", "proj/job1",
                 "--keep-last", "1")[0] == 0
    key = layout.manifest_key("proj", "job1", first.id)
    (Path(store) / "objects" / key).write_bytes(b"garbage\n")
    for _ in range(2):
        code, out, err = ciuic(capsys, monkeypatch, "--store", store, "gc")
        err = " ".join(err.split())  # as wrapped to the width
        assert code == 0 and "deleted" in out, err
        assert "1 damaged or unreadable object: no body they may name is left" in err, err
        assert f"`ciuic --store {store} gc --quarantine`" in err, err
    # the catalog rebuilt from the store lists only what it can read: the ID verify names
    assert ciuic(capsys, monkeypatch, "--store", store, "reindex")[0] == 0
    code, _, err = ciuic(capsys, monkeypatch, "--store", store, "prune", "proj/job1",
                         "--snapshot", first.id[:12])
    err = " ".join(err.split())
    assert code == 2 and "cannot be read, so it cannot be pruned" in err, err
    assert f"`ciuic --store {store} gc --quarantine`" in err, err
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "verify")
    out = " ".join(out.split())
    assert code == 1 and key in out and "--snapshot" not in out, out
    assert "step None" not in out, out
    advised = re.search(r"`(ciuic [^`]*gc --quarantine)`", out)
    assert advised is not None, out
    code, out, err = ciuic(capsys, monkeypatch, *advised[1].split()[1:])
    moved = Path(store) / "objects" / "quarantine" / key
    said = "".join(out.split())  # (wrapped at the console's width)
    assert code == 0 and f"moved{key}to{moved}" in said and not err, out + err
    assert moved.exists()  # where it says
    code, out, err = ciuic(capsys, monkeypatch, "--store", store, "gc")
    assert code == 0 and not err, err
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "verify", "--deep")
    assert code == 0 and "1 quarantined" in out, out


def test_counts_are_in_the_singular_or_the_plural(populated: dict[str, object],
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30: "pruned 1 snapshot(s)", "0 body(ies)": the count is known, so is the word."""
    store = str(populated["store"])
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "prune", "proj/job1",
                         "--keep-last", "2")
    assert code == 0 and " ".join(out.split()).startswith(
        "pruned 1 snapshot: step 9900; `ciuic"), out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "prune", "proj/job1",
                         "--keep-last", "1")
    assert code == 0 and " ".join(out.split()).startswith(
        "pruned 1 snapshot: step 10000; `ciuic"), out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "gc")
    assert code == 0 and re.fullmatch(r"deleted \d+ chunks and 0 bodies, freeing .+; kept \d+ "
                                      r"chunks", out.strip()), out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "verify", "proj/job1")
    assert code == 0 and re.fullmatch(r"proj/job1: 1 snapshot checked, 2 pruned, \d+ chunks "
                                      r"present: ok", out.strip()), out
    (Path(store) / "catalog.db").unlink()
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "reindex")
    assert code == 0 and out.strip() == ("indexed 1 snapshot and 2 pruned; 0 stale rows "
                                         "removed; 0 damaged manifests skipped"), out


@pytest.mark.parametrize("args, message", [
    (["show", "proj/job1@5"], "no snapshot at step 5"),
    (["show", "nosuchjob@latest"], "no job named 'nosuchjob'"),
    (["log", "a/b/c"], "invalid job name"),
    (["prune", "proj/job1"], "--keep-last N and/or --keep-every K"),
    (["restore", "job1@latest", "--to", "x.txt"], "cannot tell the format"),
])
def test_errors_say_what_to_do(populated: dict[str, object], capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch, args: list[str],
                               message: str) -> None:
    code, _out, err = ciuic(capsys, monkeypatch, "--store", str(populated["store"]), *args)
    assert code == 2
    assert message in " ".join(err.split())
    assert "Traceback" not in err


def test_missing_store_is_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = ciuic(capsys, monkeypatch, "--store", str(tmp_path / "nope"), "ls")
    assert code == 2 and "no ciuic store at" in err


def test_mistakes_a_user_makes_get_errors_that_say_what_to_do(
        populated: dict[str, object], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    store = str(populated["store"])
    # a typo in PROJECT/JOB is an error, not an empty, healthy job
    for cmd in ("log", "verify", "prune"):
        code, _, err = ciuic(capsys, monkeypatch, "--store", store, cmd, "proj/jbo1",
                             *(["--keep-last", "1"] if cmd == "prune" else []))
        assert code == 2 and "no job proj/jbo1" in err and "ciuic ls" in err, (cmd, err)
    code, _, err = ciuic(capsys, monkeypatch, "--store", store, "log", "other/job1")
    assert code == 2 and "jobs of that name: proj/job1" in err
    # --store at the objects/ folder (which the recovery log prints), or any other folder
    objects = Path(store) / "objects"
    before = sorted(p.name for p in objects.iterdir())
    code, _, err = ciuic(capsys, monkeypatch, "--store", str(objects), "ls")
    err = " ".join(err.split())  # as wrapped for the terminal
    assert code == 2 and "is not a ciuic store" in err and f"the store is {Path(store)}," in err
    assert sorted(p.name for p in objects.iterdir()) == before  # nothing made there
    (tmp_path / "empty").mkdir()
    code, _, err = ciuic(capsys, monkeypatch, "--store", str(tmp_path / "empty"), "ls")
    assert code == 2 and "not a ciuic store" in err and not any((tmp_path / "empty").iterdir())
    # an export to a place that cannot be written, or in an unknown format
    afile = tmp_path / "afile"  # a folder that is a file: unwritable, even for root
    afile.write_text("")
    for name in ("m.pt", "m.safetensors"):
        code, _, err = ciuic(capsys, monkeypatch, "--store", store, "restore",
                             "job1@latest", "--to", str(afile / name))
        assert code == 2 and f"{afile} is a file, not a folder" in " ".join(err.split()), err
    code, _, err = ciuic(capsys, monkeypatch, "--store", store, "restore", "job1@latest",
                         "--to", str(tmp_path / "m.pt"), "--format", "onnx")
    assert code == 2 and "unknown format 'onnx'" in err
    # no folder made, no file replaced, no format unlike the name, unasked
    code, _, err = ciuic(capsys, monkeypatch, "--store", store, "restore", "job1@latest",
                         "--to", str(tmp_path / "new" / "m.pt"))
    assert code == 2 and "does not exist: create it first" in " ".join(err.split())
    assert not (tmp_path / "new").exists()
    code, _, err = ciuic(capsys, monkeypatch, "--store", store, "restore", "job1@latest",
                         "--to", str(tmp_path / "m.safetensors"), "--format", "torch")
    assert code == 2 and "names a safetensors file" in err and "--format safetensors" in err
    code, _, _ = ciuic(capsys, monkeypatch, "--store", store, "restore", "job1@latest",
                       "--to", str(tmp_path / "m.safetensors"))
    assert code == 0 and (tmp_path / "m.safetensors").stat().st_mode & 0o044  # not 0600
    written = (tmp_path / "m.safetensors").read_bytes()
    code, _, err = ciuic(capsys, monkeypatch, "--store", store, "restore", "job1@9900",
                         "--to", str(tmp_path / "m.safetensors"))
    assert code == 2 and "exists: choose another --to, or pass --force" in " ".join(err.split())
    assert (tmp_path / "m.safetensors").read_bytes() == written
    code, _, _ = ciuic(capsys, monkeypatch, "--store", store, "restore", "job1@9900",
                       "--to", str(tmp_path / "m.safetensors"), "--force")
    assert code == 0 and (tmp_path / "m.safetensors").read_bytes() != written


def test_a_read_only_store_is_read_with_a_catalog_in_the_cache_and_refused_for_training(
        populated: dict[str, object], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A store on a read-only mount: its SQLite catalog cannot be opened for writing (the
    commands failed after 12 s), and a training job crashed with a traceback. (Root may write
    anywhere, so the mount is stood in for by ciuic.chain.home.read_only.)"""
    from ciuic import ConfigurationError
    from ciuic.chain import home

    store = Path(str(populated["store"]))
    monkeypatch.setattr(home, "read_only", lambda root: root.resolve() == store.resolve())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    catalog = store / "catalog.db"
    before = catalog.stat().st_mtime_ns, catalog.stat().st_size
    for args in (("ls",), ("log", "proj/job1"), ("verify", "--deep"), ("show", "job1@10000")):
        code, out, err = ciuic(capsys, monkeypatch, "--store", str(store), *args)
        assert code == 0, (args, err)
        assert "10100" in out or "10000" in out or "ok" in out, (args, out)
    assert (catalog.stat().st_mtime_ns, catalog.stat().st_size) == before
    assert list((tmp_path / "cache").rglob("*.db"))
    with pytest.raises(ConfigurationError, match=r"cannot be written .* writable folder"):
        SnapshotManager("proj", job="job1", store=store)


def test_output_to_a_pipe_fits_100_columns(store_dir: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30: `ciuic show P/J@S | cat` printed every health reason on one 367-character
    line, `ciuic diff A B | cat` a 117-character count of its tensors; the diff and inspect
    tables cut the tensors' paths ("model/transfo…"). Every line fits 100 columns; a tensor's
    path, an ID or a command is never broken or cut (a path too long for its column folds)."""
    model = {f"transformer.h.{i}.self_attention_query_key_value.{kind}": torch.ones(shape)
             for i in range(6) for kind, shape in (("weight", (4, 4)), ("bias", (4,)))}
    with SnapshotManager("proj", job="a_rather_long_job_name", store=store_dir,
                         handle_signals=False) as m:
        for step in range(1, 4):
            for i, t in enumerate(model.values()):
                t.add_(float("nan") if step == 3 and i < 9 else 1.0)
            m.save(step, model, loss=1.0 / step)
    ref = "proj/a_rather_long_job_name@3"
    store = str(store_dir)
    runs = {}
    for args in (("show", ref), ("diff", ref.replace("@3", "@1"), ref), ("diff", "--all",
                 ref.replace("@3", "@2"), ref), ("inspect", ref), ("log", ref[:-2]),
                 ("verify", "--deep"), ("prune", ref[:-2], "--keep-last", "1", "--dry-run"),
                 ("gc", "--dry-run"), ("reindex",)):
        code, out, err = ciuic(capsys, monkeypatch, "--store", store, *args, columns=100)
        assert code == 0 and err == "", (args, err)  # a bar to a pipe left an empty line
        assert max(map(len, out.splitlines())) <= 100, (args, out)
        runs.setdefault(args[0], out)
    assert not any("…" in out for out in runs.values())  # nothing cut
    assert "model/transformer.h.5.self_attention_query_key_value.weight" in runs["show"]
    shown = " ".join(runs["show"].split())
    assert "health unhealthy: model/transformer.h.0.self_attention_query_key_value.weight: " \
        "16 NaN of 16 elements; " in shown
    assert f"; and 8 more reasons (`ciuic inspect {ref}` lists them all)" in shown
    assert "model/transformer.h.4.self_attention_query_key_value.bias" not in shown.split(
        "chunks")[0]  # the 5th reason is left to inspect: the table follows
    assert "tensors: 12 changed, 2 unchanged, 0 added, 0 removed; 12 read" in " ".join(
        runs["diff"].split())  # and the RNG states


def test_verify_says_what_it_checked_when_the_store_lacks_what_its_catalog_lists(
        populated: dict[str, object], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 30: a store's catalog.db beside an empty objects/ (a copy that left the objects
    behind): `ciuic verify` printed nothing and exited 0."""
    import shutil

    moved = tmp_path / "moved"
    (moved / "objects").mkdir(parents=True)
    shutil.copy(Path(str(populated["store"])) / "catalog.db", moved / "catalog.db")
    code, out, _ = ciuic(capsys, monkeypatch, "--store", str(moved), "verify")
    out = " ".join(out.split())
    assert code == 1, out
    assert f"no snapshots found in the store at {moved}; its catalog lists 3" in out
    assert "proj/job1: steps 9900, 10000, 10100" in out and "ciuic reindex" in out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", str(moved), "verify", "proj/job1")
    assert code == 1 and "the catalog lists 3 snapshots the store has no manifest of" in " ".join(
        out.split()), out
    empty = tmp_path / "empty"
    (empty / "objects").mkdir(parents=True)
    code, out, _ = ciuic(capsys, monkeypatch, "--store", str(empty), "verify")
    assert code == 0 and out.strip() == f"nothing to verify: the store at {empty} holds no " \
        "snapshots, and its catalog lists none", out


def test_ls_shows_a_last_step_of_zero(store_dir: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with SnapshotManager("proj", job="only", store=store_dir, handle_signals=False) as m:
        m.save(0, nn.Linear(3, 3))
    code, out, _ = ciuic(capsys, monkeypatch, "--store", str(store_dir), "ls")
    row = next(line for line in out.splitlines() if "proj/only" in line)
    assert code == 0 and row.split()[1:3] == ["1", "0"], out


def test_a_store_this_user_may_not_read_is_one_clear_error(store_dir: Path) -> None:
    """Every command, not a traceback: the store's folder unreadable (root without its
    capabilities to override file permissions, as an ordinary user is)."""
    import os
    import shutil
    import subprocess

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv (util-linux) to drop the permission override")
    with SnapshotManager("proj", job="j", store=store_dir, handle_signals=False) as m:
        m.save(1, nn.Linear(3, 3))
    store_dir.chmod(0)
    try:
        for args in (["ls"], ["log", "proj/j"], ["verify"]):
            done = subprocess.run(
                [setpriv, "--bounding-set", "-dac_override,-dac_read_search", sys.executable,
                 "-m", "ciuic", "--store", str(store_dir), *args],
                capture_output=True, text=True, timeout=120)
            assert done.returncode == 2, (args, done.stdout, done.stderr)
            assert "Traceback" not in done.stderr, done.stderr
            assert f"cannot access {store_dir}" in done.stderr
            assert "permission denied; check that this user may read it" in done.stderr
    finally:
        store_dir.chmod(0o755)


def test_a_prune_that_cannot_delete_leaves_the_snapshot_listed(
        populated: dict[str, object], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The catalog is marked first (no reader loads a body being deleted); when the delete
    fails, the snapshot is listed as committed again, as its body still is."""
    from ciuic import faults

    store = str(populated["store"])
    faults.reload("body.delete=raise")
    code, _, err = ciuic(capsys, monkeypatch, "--store", store, "prune", "proj/job1",
                         "--keep-last", "1")
    faults.reload("")
    assert code == 2 and "body.delete" in err, err
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "log", "proj/job1", "--all")
    assert code == 0 and "pruned" not in out and "9900" in out, out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "verify")
    assert code == 0 and "0 pruned" in out, out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "prune", "proj/job1",
                         "--keep-last", "1")
    assert code == 0 and "pruned 2 snapshots" in out, out


def test_option_values_out_of_range_name_the_option(
        populated: dict[str, object], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = str(populated["store"])
    for args, option in ((["prune", "proj/job1", "--keep-last", "0"], "--keep-last"),
                         (["prune", "proj/job1", "--keep-every", "-2"], "--keep-every"),
                         (["gc", "--wait", "-5"], "--wait")):
        code, _, err = ciuic(capsys, monkeypatch, "--store", store, *args)
        assert code == 2 and f"Invalid value for '{option}'" in err, (args, err)
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "log", "proj/job1")
    assert code == 0 and "9900" in out  # nothing pruned
    code, out, _ = ciuic(capsys, monkeypatch, "prune", "--help")
    assert "--keep-every K" in out and "multiples of K" in out


def test_version(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from ciuic.version import __version__

    code, out, _ = ciuic(capsys, monkeypatch, "--version")
    assert code == 0 and out.strip() == f"ciuic {__version__}"


def test_prune_a_named_snapshot_then_restore_starts_before_it(
        populated: dict[str, object], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A damaged snapshot can be dropped by name: `verify --deep` says how, and the job's
    latest is then the one before it."""
    store = str(populated["store"])
    infos = populated["infos"]
    assert isinstance(infos, list)
    latest = infos[-1]
    with Repository.open(store) as repo:
        _, trees = read_body(repo, latest)
        refs = chunk_refs(trees)
        mine = set(refs)
        for other in infos[:-1]:
            mine -= set(chunk_refs(read_body(repo, other)[1]))
    ref = refs[sorted(mine)[0]]  # a chunk only it holds: its last byte zeroed
    path, first, n = stored_at(store, ref)
    data = bytearray(path.read_bytes())
    data[first + n - 1] = 0 if data[first + n - 1] else 1
    path.write_bytes(bytes(data))
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "verify", "--deep")
    text = " ".join(out.split())
    hint = f"ciuic --store {store} prune proj/job1 --snapshot {latest.id[:12]}"
    assert code == 1 and hint in text, out
    code, _, err = ciuic(capsys, monkeypatch, "--store", store, "prune", "proj/job1",
                         "--snapshot", "other@1")
    assert code == 2 and "other" in err
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "prune", "proj/job1",
                         "--snapshot", latest.id[:12], "--dry-run")
    assert code == 0 and out.strip() == "would prune 1 snapshot: step 10100", out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, *hint.split()[3:])
    assert code == 0 and " ".join(out.split()).startswith(
        "pruned 1 snapshot: step 10100; `ciuic"), out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "gc")
    assert code == 0
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "verify", "--deep")
    assert code == 0, out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, "restore", "proj/job1@latest",
                         "--to", str(tmp_path / "m.safetensors"))
    assert code == 0 and "from proj/job1@10000" in " ".join(out.split()), out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", store, *hint.split()[3:])
    assert code == 0 and "is pruned already" in out and "pruned 0 snapshots" in out, out


def test_references_that_name_no_job_say_so(
        populated: dict[str, object], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ciuic.errors import AmbiguousReference

    store = str(populated["store"])
    code, _, err = ciuic(capsys, monkeypatch, "--store", store, "verify", "nojob")
    assert code == 2 and "'nojob' is neither a job of this store nor a snapshot" in err, err
    code, _, err = ciuic(capsys, monkeypatch, "--store", store, "show", "@latest")
    assert code == 2 and "'@latest' names no job: write JOB@latest" in err, err
    with Repository.open(store) as repo, pytest.raises(AmbiguousReference) as e:
        repo.catalog.find_prefix("")  # every snapshot: each named with its job and step
    assert "(proj/job1@9900)" in str(e.value) and "or JOB@STEP" in str(e.value)

"""What a new user hit (a walkthrough of the README on a fresh clone), each pinned by a test that
fails without its fix: retention through a server, mistakes in step() raised at once, a typo in
the job name, where an interrupted run really stopped, and the command line's rough edges."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from torch import nn

from ciuic import SnapshotManager, StateHolder
from ciuic.chain.repo import Repository
from ciuic.chain.retention import prune_one
from ciuic.errors import AmbiguousReference, CaptureError, ConfigurationError
from ciuic.format.info import SnapshotInfo
from ciuic.manager.config import ManagerOptions
from ciuic.manager.policy import SavePolicy
from ciuic.manager.stats import ManagerStats
from tests.conftest import run_train
from tests.helpers.stored import flip
from tests.models import model_opt_stepped
from tests.serverutil import cli, new_key, serve

model_and_opt = partial(model_opt_stepped, 4, 2, batch=3)


def ciuic_cli(store: Path, *args: str, columns: int = 200, **env: str
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ciuic", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": str(columns), **env})


# -- 1. retention through the server ----------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    root = tmp_path_factory.mktemp("retention-server") / "store"
    key = new_key(root, "qs", "writer")
    with serve(root, root.parent / "server.log") as url:
        yield url, key, root


def test_retention_through_the_server_looks_pruned_everywhere(
        server: tuple[str, str, Path]) -> None:
    url, key, _ = server
    model, opt = model_and_opt()
    with SnapshotManager("qs", job="keep2", endpoint=url, api_key=key, save_interval=1,
                         keep_last=2) as m:
        for step in range(6):
            m.step(step, model, opt)
            m.wait()
        assert [s.step for s in m.repo.catalog.snapshots("qs", "keep2")] == [4, 5]
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=auth, timeout=30) as c:
        listed = c.get("/v1/projects/qs/jobs/keep2/snapshots").json()
        assert [s["step"] for s in listed["snapshots"]] == [5, 4]
        assert listed["total"] == 2
        events = c.get("/v1/projects/qs/jobs/keep2/snapshots", params={"limit": 1000}).json()
        kept = {s["id"] for s in events["snapshots"]}
        with Repository.open(server[2]) as root:  # the server's own catalog
            every = root.catalog.snapshots("qs", "keep2", status=None)
        pruned = [s for s in every if s.id not in kept]
        assert len(pruned) == 4 and all(s.status == "pruned" for s in pruned)
        for s in pruned:
            r = c.get(f"/v1/projects/qs/snapshots/{s.id}/tensors")
            assert r.status_code == 410, r.text
            assert r.json()["error"]["code"] == "pruned"
            v = c.post(f"/v1/projects/qs/snapshots/{s.id}/verify").json()
            assert v["pruned"] is True
        v = c.post(f"/v1/projects/qs/snapshots/{listed['snapshots'][0]['id']}/verify").json()
        assert v["ok"] is True and v["pruned"] is False


def test_every_catalog_follows_a_delete_whoever_made_it(tmp_path: Path) -> None:
    """Two catalogs of one store (another machine's cached index, a server's): a snapshot one
    of them prunes is pruned in the other at its next look at the job."""
    model, opt = model_and_opt()
    store = tmp_path / "store"
    with SnapshotManager("p", job="j", store=store, save_interval=1) as m:
        for step in range(3):
            m.step(step, model, opt)
            m.wait()
    here = Repository.open(store)
    there = Repository.open(store, f"sqlite:///{tmp_path / 'other.db'}")
    there.sync_job("p", "j")
    assert [s.step for s in there.catalog.snapshots("p", "j")] == [0, 1, 2]
    prune_one(here, here.catalog.snapshots("p", "j")[0])
    there.sync_job("p", "j")
    assert [s.step for s in there.catalog.snapshots("p", "j")] == [1, 2]
    assert there.catalog.snapshots("p", "j", status="pruned")[0].step == 0
    here.close()
    there.close()


# -- 2. mistakes in step() are raised at once ---------------------------------------------------

def test_integer_like_steps_are_accepted(store_dir: Path) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="np", store=store_dir, save_interval=2) as m:
        for step in np.arange(0, 5):  # the step a loop over a NumPy range gives
            m.step(step, model, opt)
        m.step(torch.tensor(6), model, opt)  # a 0-d integer tensor
        m.wait()
        assert m.stats.failures == 0
        assert [s.step for s in m.repo.catalog.snapshots("p", "np")] == [0, 2, 4, 6]


@pytest.mark.parametrize("bad", ["3", 2.0, torch.tensor(1.5), -1, True, None])
def test_a_step_that_is_not_an_integer_raises_on_the_first_call(store_dir: Path,
                                                                bad: object) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="bad", store=store_dir, save_interval=1) as m:
        with pytest.raises(ConfigurationError, match="step must be a non-negative integer"):
            m.step(bad, model, opt)  # type: ignore[arg-type]
        assert m.stats.failures == 0


def test_swapped_model_and_optimizer_raise(store_dir: Path) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="swap", store=store_dir, save_interval=1) as m:
        with pytest.raises(ConfigurationError, match="the model argument is an optimizer"):
            m.step(0, opt, model)
        with pytest.raises(ConfigurationError, match="the optimizer argument is a module"):
            m.step(0, None, model)
        with pytest.raises(ConfigurationError, match="the model argument is an optimizer"):
            m.restore(opt, model)
        with pytest.raises(ConfigurationError, match="the model argument is an optimizer"):
            m.save(0, opt, model)


@pytest.mark.parametrize("first_step_due", [True, False])
def test_an_extra_that_cannot_be_captured_raises_on_the_first_call(
        store_dir: Path, first_step_due: bool) -> None:
    model, opt = model_and_opt()
    loader = torch.utils.data.DataLoader(list(range(8)))  # no state_dict(), not a value
    with SnapshotManager("p", job="extra", store=store_dir,
                         save_interval=1 if first_step_due else 100) as m:
        with pytest.raises(CaptureError):
            m.step(1, model, opt, loader=loader)
        assert m.stats.failures == 0
        m.step(1, model, opt, ema=StateHolder({"w": torch.zeros(2)}))  # a good one is fine


def test_storage_faults_are_still_logged_and_training_goes_on(store_dir: Path) -> None:
    from ciuic import faults

    model, opt = model_and_opt()
    with SnapshotManager("p", job="fault", store=store_dir, save_interval=1,
                         asynchronous=False) as m:
        faults.reload("body.put=raise@1")
        assert m.step(0, model, opt) is False  # logged and counted, not raised
        assert m.stats.failures == 1
        faults.reload("")
        assert m.step(1, model, opt) is True


# -- 3. a typo in the job name -----------------------------------------------------------------

def _start_beside(store: Path, caplog: pytest.LogCaptureFixture, project: str, existing: str,
                  job: str) -> list[logging.LogRecord]:
    """Snapshot job ``existing``, then start ``job`` of the same project from scratch: the
    records that say it has no snapshot."""
    model, opt = model_and_opt()
    with SnapshotManager(project, job=existing, store=store, save_interval=1) as m:
        m.step(0, model, opt)
    with caplog.at_level(logging.INFO, logger="ciuic"), SnapshotManager(
            project, job=job, store=store) as m:
        assert m.restore(model, opt) is None
    return [r for r in caplog.records if f"No snapshot of {project}/{job}" in r.getMessage()]


def test_a_typo_in_the_job_name_warns_with_the_nearest_jobs(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = _start_beside(store_dir, caplog, "qs", "killed", "kiled")
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    text = lines[0].getMessage()
    assert f"No snapshot of qs/kiled in {store_dir}: starting from scratch" in text
    assert "objects" not in text
    assert "killed" in text and "job='killed'" in text


def test_a_new_job_beside_jobs_of_other_names_starts_quietly(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`job="hang"` beside a job "exc" is no typo: no advice to pass job='exc'."""
    [line] = _start_beside(store_dir, caplog, "runproj", "exc", "hang")
    assert line.levelno == logging.INFO and "job=" not in line.getMessage()


def test_a_new_run_of_a_numbered_series_starts_quietly(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 42: every new numbered run warned "similar name: run-2 ... pass job='run-2'". A
    name that differs only in its numbers is the next of a series; a typo still warns."""
    [line] = _start_beside(store_dir, caplog, "series", "run-2", "run-3")
    assert line.levelno == logging.INFO and "job=" not in line.getMessage()
    caplog.clear()
    [typo] = _start_beside(store_dir, caplog, "series", "run-3", "rnu-3")
    assert typo.levelno == logging.WARNING and "job='run-3'" in typo.getMessage()


def test_a_new_project_starts_quietly(store_dir: Path, caplog: pytest.LogCaptureFixture
                                      ) -> None:
    model, opt = model_and_opt()
    with caplog.at_level(logging.INFO, logger="ciuic"), SnapshotManager(
            "fresh", job="one", store=store_dir) as m:
        assert m.restore(model, opt) is None
    [line] = [r for r in caplog.records if "No snapshot of" in r.getMessage()]
    assert line.levelno == logging.INFO


def test_api_key_without_an_endpoint_is_said_once(store_dir: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    from ciuic.manager import session as facade

    facade._warned.clear()
    with caplog.at_level(logging.INFO, logger="ciuic"):
        for _ in range(2):
            SnapshotManager("p", job="k", store=store_dir, api_key="your_api_key").close()
    said = [r for r in caplog.records if "api_key= is the key of a ciuic server" in
            r.getMessage()]
    assert len(said) == 1


# -- 4. where the job stopped --------------------------------------------------------------------

def test_the_restart_names_the_step_where_the_run_died(store_dir: Path) -> None:
    run = run_train(store_dir, "--steps", "40", "--save-every", "10", "--kill-at", "23",
                    "--sync")  # snapshots committed in step(): step 20's is the latest
    assert run.rc == -9
    again = run_train(store_dir, "--steps", "40", "--save-every", "10", "--sync")
    assert again.rc == 0, again.err
    assert "Detected training interruption at step 23 (it was killed" in again.err
    assert "Found snapshot at step 20" in again.err
    assert "Loading snapshot from" in again.err and "Downloading" not in again.err


def waits_for_the_first(policy: SavePolicy, caplog: pytest.LogCaptureFixture) -> bool:
    """Whether a long wait for the process's first snapshot is warned about."""
    policy.last_save_time = time.monotonic() - 0.1
    with caplog.at_level(logging.WARNING, logger="ciuic"):
        assert policy.proceed_while_busy(1, lambda: time.sleep(0.2))
    return "waited" in caplog.text


def test_a_wait_is_worth_a_warning_only_when_it_matters(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    from ciuic.distributed.collective import Collective

    stats = ManagerStats()
    policy = SavePolicy(ManagerOptions("p").check(), Collective(False), stats)
    assert not waits_for_the_first(policy, caplog)  # it pays once for buffers: no warning
    stats.snapshots = 1  # the waits below are for later snapshots

    def waits(seconds: float, since: float) -> bool:
        policy.last_save_time = time.monotonic() - since
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ciuic"):
            assert policy.proceed_while_busy(20, lambda: time.sleep(seconds))
        return any("waited" in r.getMessage() for r in caplog.records)

    assert not waits(0.06, since=10.0)  # 0.6 % of the interval: not worth a word
    assert not waits(0.0, since=10.0)
    assert waits(0.3, since=1.0)  # 30 %: it matters
    policy._warned_busy = False
    assert not waits(0.0, since=10.0)  # no wait: the streak starts again
    assert not waits(0.06, since=10.0)
    assert not waits(0.06, since=10.0)
    assert waits(0.06, since=10.0)  # the third wait in a row
    assert stats.waited_s > 0.5


def test_a_wait_with_no_training_time_since_the_last_snapshot_gives_no_share(
        caplog: pytest.LogCaptureFixture) -> None:
    """Snapshots due at once, no compute between them: the warning said '15778 % of the 0.00 s
    since it started'; it says the steps between took under 10 ms, and keeps its advice."""
    from ciuic.distributed.collective import Collective

    stats = ManagerStats()
    stats.snapshots = 1  # not the process's first
    policy = SavePolicy(ManagerOptions("p").check(), Collective(False), stats)
    policy.last_save_time = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ciuic"):
        assert policy.proceed_while_busy(2, lambda: time.sleep(0.06))
    [warning] = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert "(the steps between the two snapshots took under 10 ms)" in warning, warning
    assert "%" not in warning, warning
    assert "Consider a larger save_interval, or on_busy='skip'" in warning, warning


# -- 5. the command line -------------------------------------------------------------------------

def test_apikey_create_prints_the_key_alone_on_stdout(tmp_path: Path) -> None:
    run = ciuic_cli(tmp_path / "store", "apikey", "create", "--project", "p", "--role",
                    "reader")
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("\n") == 1 and run.stdout.startswith("ciuic_")
    assert "keep it secret" in run.stderr
    listed = ciuic_cli(tmp_path / "store", "apikey", "list", columns=40)
    key_id = run.stdout.split("_")[1]
    assert key_id in listed.stdout  # whole, in a narrow terminal: `revoke` takes it
    revoked = ciuic_cli(tmp_path / "store", "apikey", "revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr


def test_output_to_a_pipe_is_not_wrapped(store_dir: Path) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="wide", store=store_dir, save_interval=1) as m:
        m.step(0, model, opt)
        m.wait()
        sid = m.latest().id  # type: ignore[union-attr]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    run = subprocess.run([sys.executable, "-m", "ciuic", "--store", str(store_dir), "show",
                          "p/wide@0"], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert sid in run.stdout  # the 64-character ID on one line


def test_output_to_a_pipe_fits_100_columns(store_dir: Path) -> None:
    """`ciuic log > file` (and `make demo > file`) were 200 to 1000 columns wide."""
    model, opt = model_and_opt()
    metrics = {f"metric_{i}": 0.5 + i for i in range(12)}  # a long notes column
    with SnapshotManager("p", job="wide", store=store_dir, save_interval=1) as m:
        m.step(0, model, opt, **metrics)
        m.wait()
        sid = m.latest().id  # type: ignore[union-attr]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = {}
    for args in (("log", "p/wide"), ("ls",)):
        run = subprocess.run([sys.executable, "-m", "ciuic", "--store", str(store_dir), *args],
                             capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stderr
        assert max(map(len, run.stdout.splitlines())) <= 100, run.stdout
        out[args[0]] = run.stdout
    assert sid[:12] in out["log"] and "metric_11=11.5" in out["log"]  # whole, wrapped by word


def test_log_shows_interruptions_resumes_and_lineages(store_dir: Path) -> None:
    run = run_train(store_dir, "--steps", "30", "--save-every", "10", "--kill-at", "13")
    assert run.rc == -9
    assert run_train(store_dir, "--steps", "30", "--save-every", "10").rc == 0
    assert run_train(store_dir, "--steps", "30", "--save-every", "10",
                     "--no-restore").rc == 0  # a second lineage of the same steps
    out = ciuic_cli(store_dir, "log", "mlp")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "lineage 2 of 2" in text and "lineage 1 of 2" in text
    assert text.index("lineage 2 of 2") < text.index("lineage 1 of 2")  # newest first
    assert "stopped at step 13: was killed or crashed" in text
    assert "resumed by run" in text
    ambiguous = ciuic_cli(store_dir, "show", "mlp@10")
    assert ambiguous.returncode == 2
    assert "2 snapshots at step 10, in different lineages" in ambiguous.stderr


def test_job_at_step_is_ambiguous_across_lineages(store_dir: Path) -> None:
    model, opt = model_and_opt()
    for _ in range(2):  # two runs that never restore: two lineages
        with SnapshotManager("p", job="two", store=store_dir, save_interval=1) as m:
            m.step(0, model, opt)
    with Repository.open(store_dir) as repo, pytest.raises(AmbiguousReference,
                                                           match="Name one by its ID prefix"):
        repo.resolve("p/two@0")


def three_snapshots(store: Path, job: str) -> tuple[nn.Linear, torch.optim.SGD, SnapshotInfo]:
    """A model and optimizer, after 3 snapshots of job ``p/<job>``, each with new chunks; and
    the latest."""
    model = nn.Linear(64, 64)  # 16 KiB of weights: chunks, not inline values
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with SnapshotManager("p", job=job, store=store, save_interval=1) as m:
        for step in range(3):
            model.weight.data += 1  # every snapshot new chunks
            m.step(step, model, opt)
            m.wait()
        latest = m.latest()
    assert latest is not None
    return model, opt, latest


def test_gc_reports_the_bytes_it_freed(store_dir: Path) -> None:
    three_snapshots(store_dir, "gc")
    assert ciuic_cli(store_dir, "prune", "p/gc", "--keep-last", "1").returncode == 0
    out = ciuic_cli(store_dir, "gc")
    assert out.returncode == 0, out.stderr
    assert "freeing" in out.stdout and " 0 B" not in out.stdout


def test_restore_of_a_damaged_snapshot_names_the_previous_intact_one(store_dir: Path,
                                                                      tmp_path: Path) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="dmg", store=store_dir, save_interval=1) as m:
        for step in range(2):
            model.weight.data += 1
            m.step(step, model, opt)
            m.wait()
        latest = m.latest()
        first = m.repo.catalog.snapshots("p", "dmg")[0]
    assert latest is not None
    from ciuic.chain.read import read_body
    from ciuic.chain.repo import Repository as Repo
    from ciuic.format import layout

    with Repo.open(store_dir) as repo:
        _, trees = read_body(repo, latest)
    weight = trees["model"]["weight"]
    digest = weight["chunks"][0][0] if "chunks" in weight else None
    if digest is None:  # a small tensor lives inline: damage the body instead
        path = store_dir / "objects" / layout.body_key("p", "dmg", latest.body)
    else:
        path = store_dir / "objects" / layout.chunk_key(digest)
    path.write_bytes(b"damaged")
    out = ciuic_cli(store_dir, "restore", "p/dmg@latest", "--to", str(tmp_path / "m.pt"))
    assert out.returncode == 2
    assert "The newest intact snapshot before it is p/dmg@0" in out.stderr
    # the command to paste names the store it was given (else it looks in ./.ciuic)
    assert f"ciuic --store {store_dir} restore {first.short_id} --to" in " ".join(
        out.stderr.split())


def test_restore_says_what_it_wrote_and_in_which_format(store_dir: Path, tmp_path: Path
                                                        ) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="fmt", store=store_dir, save_interval=1) as m:
        m.step(0, model, opt)
    out = ciuic_cli(store_dir, "restore", "p/fmt@0", "--to", str(tmp_path / "model.bin"))
    assert out.returncode == 0, out.stderr
    assert "the model's" in out.stdout and "in torch format" in out.stdout
    assert "--state NAME" in out.stdout
    assert torch.equal(torch.load(tmp_path / "model.bin")["weight"], model.weight)


def test_verify_without_the_key_says_what_could_not_be_checked(store_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    from ciuic.format.crypto import generate_key_text

    model, opt = model_and_opt()
    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", generate_key_text())
    with SnapshotManager("p", job="sealed", store=store_dir, save_interval=1,
                         encryption=True) as m:
        m.step(0, model, opt)
    env = {k: v for k, v in os.environ.items() if k != "CIUIC_ENCRYPTION_KEY"}
    run = subprocess.run([sys.executable, "-m", "ciuic", "--store", str(store_dir), "verify",
                          "--deep"], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1
    assert "could not be checked" in run.stdout
    assert "problem" not in run.stdout  # nothing damaged was found
    assert "which is not configured" in run.stdout


def test_help_screens_show_no_type_labels() -> None:
    for args in (["--help"], ["restore", "--help"], ["verify", "--help"], ["gc", "--help"]):
        run = subprocess.run([sys.executable, "-m", "ciuic", *args], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "COLUMNS": "120"})
        assert run.returncode == 0, run.stderr
        for label in ("<bool>", "{snap}", "<str>", "<path>", "<float>", "<list"):
            assert label not in run.stdout, (args, label, run.stdout)
    usage = subprocess.run([sys.executable, "-m", "ciuic", "restore", "--help"],
                           capture_output=True, text=True, timeout=120).stdout
    assert "restore [OPTIONS] SNAP" in usage


def test_server_cli_helper_still_finds_the_key(tmp_path: Path) -> None:
    store = tmp_path / "store"
    key = new_key(store, "p", "writer")
    listed = cli(store, "apikey", "list")
    assert key.split("_")[1] in listed.stdout


def test_output_to_a_pipe_follows_columns_set_after_import(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The CLI's console is made at import: a width read then (a test setting COLUMNS later,
    or a script) wrapped tables at 100 columns whatever COLUMNS said when printing."""
    from ciuic.cli.app import PIPE_COLUMNS, _console

    monkeypatch.delenv("COLUMNS", raising=False)
    console = _console()
    if console.is_terminal:
        pytest.skip("standard output is a terminal here")
    assert console.width == PIPE_COLUMNS
    monkeypatch.setenv("COLUMNS", "200")
    assert console.width == 200
    with console.capture() as out:
        console.print("x" * 150, soft_wrap=False)
    assert max(map(len, out.get().splitlines())) == 150  # one line: 200 wide


def test_ciuic_log_shows_a_snapshot_a_restore_skipped_as_damaged_and_why(store_dir: Path
                                                                         ) -> None:
    """A restore that skipped the latest snapshot for damage (issue 42, item 11): ``ciuic log``
    shows that snapshot ``damaged`` (not ``ok``) with the reason, and the note of the snapshot
    the run resumed from says which one it skipped and why."""
    from ciuic.chain.read import read_body
    from ciuic.format.descriptor import TensorDescriptor

    model, opt, latest = three_snapshots(store_dir, "skip")
    with Repository.open(store_dir) as repo:
        _, trees = read_body(repo, latest)
    flip(store_dir, TensorDescriptor.from_json(trees["model"]["weight"]["$tensor"]).chunks[0],
         20, 0xFF)
    with SnapshotManager("p", job="skip", store=store_dir, save_interval=1) as m:
        assert m.restore(model, opt) == 1
        run = m.run_id
    out = ciuic_cli(store_dir, "log", "p/skip", columns=400)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[1]: line for line in out.stdout.splitlines()
            if len(line.split()) > 2 and line.split()[1].isdigit()}  # by step
    assert " damaged " in rows["2"] and " ok " not in rows["2"], out.stdout
    assert f"found by run {run[:8]}'s restore, which skipped it" in rows["2"], out.stdout
    assert " ok " in rows["1"], out.stdout
    assert (f"resumed by run {run[:8]}; step 2 ({latest.id[:8]}) was damaged: " in rows["1"]
            ), out.stdout

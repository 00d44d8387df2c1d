"""The command line run on a server's own storage (`ciuic --store /srv/ciuic log ...`, as an
administrator does beside `ciuic --store /srv/ciuic serve`): the server keeps each project's
store in ``projects/<name>/``, and the CLI reads it there. No read-only command changes what
the server lists."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from ciuic import SnapshotManager
from tests.serverutil import cli, new_key, serve
from tests.test_server import mlp

STEPS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    """A running server whose project "vision" has a job "r5" of 6 snapshots, saved by a
    SnapshotManager through the API (a second run resumed it: the log has run notes)."""
    store = tmp_path_factory.mktemp("served") / "store"
    key = new_key(store, "vision", "writer")
    with serve(store, store.parent / "server.log") as url:
        model, opt = mlp()
        for _ in range(2):
            with SnapshotManager("vision", job="r5", api_key=key, endpoint=url,
                                 handle_signals=False) as m:
                start = m.restore(model, opt)
                first = 0 if start is None else start + 1
                for step in range(first, first + STEPS // 2):
                    with torch.no_grad():
                        model[0].bias.add_(1.0)
                    m.save(step, model, opt, loss=1.0 / (step + 1))
        yield url, store, key


def _listed(url: str, key: str) -> dict[str, int]:
    jobs = httpx.get(f"{url}/v1/projects/vision/jobs",
                     headers={"Authorization": f"Bearer {key}"}).json()["jobs"]
    return {j["job"]: j["snapshots"] for j in jobs if j["job"] != "default"}


def test_the_cli_reads_a_servers_storage_and_never_empties_its_listing(
        served: tuple[str, Path, str], tmp_path: Path) -> None:
    url, store, key = served
    assert _listed(url, key) == {"r5": STEPS}

    log = cli(store, "log", "vision/r5")
    assert log.returncode == 0, log.stderr
    assert "has no snapshots" not in log.stdout
    rows = [line for line in log.stdout.splitlines() if line.split()[:1] and
            len(line.split()) > 2 and line.split()[1].isdigit()]
    assert sorted(int(r.split()[1]) for r in rows) == list(range(STEPS)), log.stdout
    assert _listed(url, key) == {"r5": STEPS}

    ls = cli(store, "ls")
    assert ls.returncode == 0 and "vision/r5" in ls.stdout, ls.stdout + ls.stderr
    assert f" {STEPS} " in ls.stdout.split("vision/r5", 1)[1].splitlines()[0]

    verify = cli(store, "verify", "--deep")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert f"vision/r5: {STEPS} snapshots checked" in verify.stdout
    assert "re-hashed" in verify.stdout and "ok" in verify.stdout

    show = cli(store, "show", "vision/r5@latest")
    assert show.returncode == 0 and "vision/r5" in show.stdout, show.stdout + show.stderr
    out = tmp_path / "model.safetensors"
    restored = cli(store, "restore", "vision/r5@latest", "--to", str(out))
    assert restored.returncode == 0, restored.stderr
    model, _ = mlp()
    with torch.no_grad():
        for _ in range(STEPS):
            model[0].bias.add_(1.0)
    for name, value in load_file(out).items():
        assert torch.equal(value, model.state_dict()[name]), name

    dry = cli(store, "prune", "vision/r5", "--keep-last", "2", "--dry-run")
    assert dry.returncode == 0 and "would prune 4 snapshots" in dry.stdout, dry.stdout
    gc = cli(store, "gc", "--dry-run")
    assert gc.returncode == 0 and "would delete 0 chunks" in gc.stdout, gc.stdout + gc.stderr
    assert _listed(url, key) == {"r5": STEPS}

    before = cli(store, "log", "vision/r5").stdout
    again = cli(store, "reindex")
    assert again.returncode == 0, again.stderr
    assert f"indexed {STEPS} snapshots" in again.stdout and "0 stale" in again.stdout
    assert _listed(url, key) == {"r5": STEPS}
    assert cli(store, "log", "vision/r5").stdout == before  # run notes are not doubled

    # a commit whose catalog row was never written (a crash between the two): `ls` and `log`
    # see the manifest in the project's store and add the row
    from ciuic.catalog import Catalog

    catalog = Catalog(f"sqlite:///{store / 'catalog.db'}")
    newest = catalog.snapshots("vision", "r5", newest_first=True)[0]
    catalog.remove_snapshot(newest.id)
    catalog.close()
    ls = cli(store, "ls")
    assert f" {STEPS} " in ls.stdout.split("vision/r5", 1)[1].splitlines()[0], ls.stdout
    assert newest.short_id in cli(store, "log", "vision/r5").stdout

    # an administrator's prune and gc free the project's chunks, in the project's store
    assert "pruned 4 snapshots" in cli(store, "prune", "vision/r5", "--keep-last", "2").stdout
    gc = cli(store, "gc")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert int(gc.stdout.split("deleted ", 1)[1].split()[0]) > 0, gc.stdout
    assert _listed(url, key) == {"r5": 2}
    assert "2 snapshots checked" in cli(store, "verify", "--deep", "vision/r5").stdout


def test_a_catalog_row_whose_manifest_the_store_does_not_list_is_never_marked_pruned(
        tmp_path: Path) -> None:
    """The same catalog opened over the wrong store (a server's storage read at its root, a
    moved folder): the rows stay as they are, since only a listed manifest whose body is gone
    is a pruned snapshot."""
    from ciuic.chain.repo import Repository
    from ciuic.store.local import LocalStore

    model, opt = mlp()
    with SnapshotManager("p", job="j", store=str(tmp_path / "a"), handle_signals=False) as m:
        m.save(1, model, opt)
        m.save(2, model, opt)
    catalog = f"sqlite:///{tmp_path / 'a' / 'catalog.db'}"
    with Repository.open(LocalStore(tmp_path / "empty"), catalog) as wrong:
        wrong.sync_job("p", "j")
        statuses = {s.status for s in wrong.catalog.snapshots("p", "j", status=None)}
    assert statuses == {"committed"}


def test_the_end_of_a_run_reaches_the_server_after_the_reports_in_flight(
        served: tuple[str, Path, str], caplog: pytest.LogCaptureFixture) -> None:
    """The run's last report was sent while a background report was still in flight, and the
    store closed under it: 'could not send run ...'s record (Bad file descriptor)'."""
    url, store, key = served
    model, opt = mlp()
    with caplog.at_level(logging.WARNING, logger="ciuic"):
        for _ in range(3):
            with SnapshotManager("vision", job="ends", api_key=key, endpoint=url,
                                 handle_signals=False) as m:
                m.restore(model, opt)
                m.save(1, model, opt)
    assert "could not send run" not in caplog.text
    runs = [line for line in cli(store, "log", "vision/ends").stdout.splitlines()
            if "resumed by run" in line]
    assert runs, cli(store, "log", "vision/ends").stdout

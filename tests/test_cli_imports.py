"""The command line imports torch only for the commands that need it (restore --to, demo): its
other commands, and `import ciuic` itself, start without it. The help, `ls` and `log` start at
once (#19: 0.3 s): they import neither SQLAlchemy (the catalog's ORM) nor pydantic, Typer,
rich.progress or rich.markdown; `ls` and `log` read an up-to-date catalog with sqlite3
(ciuic.chain.listing), and show what the repository's way shows. Checked by looking at what was
imported when the command ends, not by timing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import click

from ciuic import SnapshotManager
from ciuic.format import layout
from tests.conftest import run_train
from tests.models import model_opt

PROBE = """
import atexit, sys
HEAVY = ("torch", "numpy", "safetensors", "transformers", "lightning", "accelerate", "deepspeed",
         "sqlalchemy", "pydantic", "typer", "rich.progress", "rich.markdown")
atexit.register(lambda: print("IMPORTED " + " ".join(m for m in HEAVY if m in sys.modules),
                              file=sys.stderr))
sys.argv = ["ciuic", *sys.argv[1:]]
from ciuic.cli import main
main()
"""


def probe(store: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str],
                                                        set[str]]:
    """``ciuic --store STORE ARGS`` and the heavy modules it imported."""
    run = subprocess.run([sys.executable, "-c", PROBE, "--store", str(store), *args],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "200", **env})
    lines = run.stderr.splitlines(keepends=True)
    last = [line for line in lines if line.startswith("IMPORTED")]
    assert last, run.stderr
    run.stderr = "".join(line for line in lines if not line.startswith("IMPORTED"))
    return run, set(last[-1].split()[1:])


def ciuic(store: Path, *args: str) -> tuple[int, set[str]]:
    run, imported = probe(store, *args)
    return run.returncode, imported


def command_lines(group: click.Group | None = None) -> list[list[str]]:
    """Every command of ``ciuic``, as typed: ["ls"], ..., ["apikey"], ["apikey", "create"]."""
    from ciuic.cli import (  # noqa: F401 - registering them
        commands,
        copying,
        inspect,
        run,
        server,
        upkeep,
    )
    from ciuic.cli.app import app

    found = []
    for name, command in (group or app).commands.items():
        found.append([name])
        if isinstance(command, click.Group):
            found += [[name, *line] for line in command_lines(command)]
    return found


def test_import_ciuic_imports_no_torch_and_no_framework() -> None:
    run = subprocess.run([sys.executable, "-c", "import sys, ciuic, ciuic.integrations; "
                          "print(sorted(m for m in ('torch', 'numpy', 'transformers', "
                          "'lightning', 'pytorch_lightning', 'accelerate', 'deepspeed') "
                          "if m in sys.modules))"],
                         capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "[]", run.stdout + run.stderr


def test_commands_that_read_the_chain_do_not_import_torch(tmp_path: Path) -> None:
    store = tmp_path / "store"
    model, opt = model_opt(64, 64, seed=None)
    # raw chunks: a compressed one needs NumPy to be decoded (verify --deep would import it)
    with SnapshotManager("p", job="j", store=store, save_interval=1, compression="off") as m:
        m.step(0, model, opt)
        m.step(1, model, opt)
    for args in (["--help"], ["ls"], ["log", "p/j"], ["show", "p/j@latest"],
                 ["verify", "--deep"], ["gc", "--dry-run"]):
        rc, imported = ciuic(store, *args)
        assert rc == 0, args
        assert "torch" not in imported and "numpy" not in imported, (args, imported)
    rc, imported = ciuic(store, "restore", "p/j@latest", "--to", str(tmp_path / "m.pt"))
    assert rc == 0 and "torch" in imported  # the export writes torch's format


def test_help_imports_neither_torch_nor_the_catalog(tmp_path: Path) -> None:
    lines = command_lines()
    assert ["log"] in lines and ["apikey", "revoke"] in lines and len(lines) == 22
    for args in (["--help"], ["-h"], *([*line, "--help"] for line in lines)):
        run, imported = probe(tmp_path, *args)
        assert run.returncode == 0 and "Usage:" in run.stdout, (args, run.stderr)
        assert not imported, (args, imported)  # not even SQLAlchemy: the help is Click's alone


def test_ls_and_log_read_an_up_to_date_catalog_as_the_repository_does(tmp_path: Path) -> None:
    """On a catalog that knows the whole store, `ls` and `log` import no SQLAlchemy, and print
    what the repository's way prints (taken here with the same catalog named by
    CIUIC_CATALOG, which the quick reader leaves to the repository): interruptions, resumes,
    lineages, an unhealthy snapshot's reasons, a pruned one."""
    store = tmp_path / "store"
    train = ("--steps", "30", "--save-every", "10")
    assert run_train(store, *train, "--kill-at", "13").rc == -9
    assert run_train(store, *train).rc == 0  # resumes the killed run
    assert run_train(store, *train, "--no-restore").rc == 0  # a second lineage
    model, opt = model_opt(8, 8, seed=None)
    with SnapshotManager("p", job="sick", store=store, save_interval=1) as m:
        for step, loss in enumerate((1.0, float("nan"), 0.5, 0.25)):
            m.step(step, model, opt, loss=loss)
    run, _ = probe(store, "prune", "p/sick", "--keep-last", "3")
    assert run.returncode == 0 and "pruned 1 snapshot: step 0" in run.stdout, run.stderr
    orm = {"CIUIC_CATALOG": f"sqlite:///{store / 'catalog.db'}"}
    for args in (["ls"], ["log", "mlp"], ["log", "tests/mlp", "--all"], ["log", "sick"],
                 ["log", "p/sick", "--all"]):
        quick, imported = probe(store, *args)
        assert quick.returncode == 0, (args, quick.stderr)
        assert not imported, (args, imported)
        slow, imported = probe(store, *args, **orm)
        assert "sqlalchemy" in imported, args
        assert (quick.returncode, quick.stdout, quick.stderr) == (
            slow.returncode, slow.stdout, slow.stderr), args
        if args[1:2] == ["mlp"]:
            assert "lineage 2 of 2" in quick.stdout and "resumed by run" in quick.stdout
            assert "stopped at step 13: was killed or crashed" in quick.stdout
        if args[1:] == ["p/sick", "--all"]:
            assert "unhealthy" in quick.stdout and "loss is nan" in quick.stdout
            assert quick.stdout.count("pruned") == 1


def test_ls_and_log_list_what_the_catalog_lacks(tmp_path: Path) -> None:
    """A store the catalog is behind: a copy of a store's objects with no catalog, a snapshot
    committed while the catalog was elsewhere, a body deleted behind its back. `ls` and `log`
    then sync the catalog through the repository (SQLAlchemy) and show the store as it is."""
    store = tmp_path / "store"
    model, opt = model_opt(8, 8, seed=None)

    def save(m: SnapshotManager, step: int) -> None:
        model.weight.data.add_(1.0)  # a body of its own (bodies are content-addressed)
        m.step(step, model, opt)

    with SnapshotManager("p", job="j", store=store, save_interval=1) as m:
        save(m, 0)
        save(m, 1)
    shutil.copy(store / "catalog.db", tmp_path / "two.db")  # knows steps 0 and 1
    with SnapshotManager("p", job="j", store=store, save_interval=1) as m:
        save(m, 2)
        m.wait()
        saved = [s.id for s in m.repo.catalog.snapshots("p", "j")]
    assert len(saved) == 3

    copy = tmp_path / "copy"
    shutil.copytree(store / "objects", copy / "objects")
    for quick in (False, True):  # the first builds the catalog, the second reads it
        run, imported = probe(copy, "ls")
        assert run.returncode == 0 and _snaps(run.stdout, "p/j") == "3", run.stdout
        assert ("sqlalchemy" in imported) is not quick

    for name in ("catalog.db-wal", "catalog.db-shm"):
        (store / name).unlink(missing_ok=True)
    shutil.copy(tmp_path / "two.db", store / "catalog.db")  # the catalog lacks step 2
    run, imported = probe(store, "log", "p/j")
    assert run.returncode == 0 and "sqlalchemy" in imported
    assert [sid[:12] in run.stdout for sid in saved] == [True, True, True], run.stdout

    first = store / "objects" / layout.body_key("p", "j", _body(store, saved[0]))
    first.unlink()  # the catalog still holds it committed
    run, imported = probe(store, "log", "p/j")
    assert run.returncode == 0 and "sqlalchemy" in imported
    assert saved[0][:12] not in run.stdout and saved[1][:12] in run.stdout
    run, imported = probe(store, "log", "p/j", "--all")
    assert "sqlalchemy" not in imported  # in sync again
    assert run.stdout.count("pruned") == 1 and saved[0][:12] in run.stdout
    run, imported = probe(store, "ls")
    assert _snaps(run.stdout, "p/j") == "2" and not imported


def _snaps(ls: str, job: str) -> str:
    """The "snaps" column of ``job``'s row in the output of `ciuic ls`."""
    row = next(line.split() for line in ls.splitlines() if job in line.split())
    return row[1]


def _body(store: Path, snapshot_id: str) -> str:
    from ciuic.chain.repo import Repository

    with Repository.open(store) as repo:
        return repo.catalog.get(snapshot_id).body


def test_the_roles_in_the_help_are_the_catalogs() -> None:
    from ciuic.catalog.keys import ROLES
    from ciuic.cli import server

    assert server.ROLES == ROLES

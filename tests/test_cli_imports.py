"""The command line imports torch only for the commands that need it (restore --to, demo): its
other commands, and `import ciuic` itself, start without it. Checked by looking at what was
imported when the command ends, not by timing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from ciuic import SnapshotManager

PROBE = """
import atexit, sys
HEAVY = ("torch", "numpy", "safetensors", "transformers", "lightning", "accelerate", "deepspeed",
         "sqlalchemy")
atexit.register(lambda: print("IMPORTED " + " ".join(m for m in HEAVY if m in sys.modules),
                              file=sys.stderr))
sys.argv = ["ciuic", *sys.argv[1:]]
from ciuic.cli import main
main()
"""


def ciuic(store: Path, *args: str) -> tuple[int, set[str]]:
    run = subprocess.run([sys.executable, "-c", PROBE, "--store", str(store), *args],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "200"})
    last = [line for line in run.stderr.splitlines() if line.startswith("IMPORTED")]
    assert last, run.stderr
    return run.returncode, set(last[-1].split()[1:])


def test_import_ciuic_imports_no_torch_and_no_framework() -> None:
    run = subprocess.run([sys.executable, "-c", "import sys, ciuic, ciuic.integrations; "
                          "print(sorted(m for m in ('torch', 'numpy', 'transformers', "
                          "'lightning', 'pytorch_lightning', 'accelerate', 'deepspeed') "
                          "if m in sys.modules))"],
                         capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "[]", run.stdout + run.stderr


def test_commands_that_read_the_chain_do_not_import_torch(tmp_path: Path) -> None:
    store = tmp_path / "store"
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
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
    for args in (["--help"], ["diff", "--help"], ["apikey", "--help"], ["restore", "--help"]):
        rc, imported = ciuic(tmp_path, *args)
        assert rc == 0, args
        assert not imported, (args, imported)  # not even SQLAlchemy: the help is Typer's alone


def test_the_roles_in_the_help_are_the_catalogs() -> None:
    from ciuic.catalog.keys import ROLES
    from ciuic.cli import server

    assert server.ROLES == ROLES

"""The layout check (scripts/layout.py): the project passes it, and it fails on a cycle, on a
lower layer importing a higher one, and on a module over 600 lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "layout.py"


def layout(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120)


def test_the_project_has_no_cycles_no_upward_imports_and_small_modules() -> None:
    run = layout()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "module import cycles: 0" in run.stdout
    assert "imports against the layers: 0" in run.stdout
    assert "ciuic.manager.facade" in run.stdout  # it read the real tree


def test_the_check_fails_on_each_kind_of_defect(tmp_path: Path) -> None:
    pkg = tmp_path / "ciuic"
    for sub in ("format", "chain"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text('"""x."""\n')
    (pkg / "__init__.py").write_text('"""x."""\n')
    (pkg / "errors.py").write_text('"""x."""\n')
    (pkg / "format" / "a.py").write_text("def f() -> None:\n    from ciuic.chain import b\n")
    (pkg / "chain" / "b.py").write_text("from ciuic.format import a\n" + "x = 1\n" * 600)
    run = layout("--root", str(tmp_path))
    assert run.returncode == 1
    assert "module import cycles: 1" in run.stdout
    assert "ciuic.chain.b <-> ciuic.format.a" in run.stdout
    assert "ciuic.format (level 1) -> ciuic.chain (level 3)" in run.stdout
    assert "modules over 600 lines: ciuic.chain.b" in run.stdout


def test_the_snapshot_manager_stays_within_350_lines() -> None:
    """The facade users read first (issue 48: it had grown to 365 lines again): what it does
    beyond delegating belongs in the manager's other modules."""
    import ast

    facade = SCRIPT.parent.parent / "src" / "ciuic" / "manager" / "facade.py"
    tree = ast.parse(facade.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SnapshotManager"]
    assert cls.end_lineno is not None
    assert cls.end_lineno - cls.lineno + 1 <= 350

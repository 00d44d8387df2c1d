"""A store on a full disk and on a read-only file system, each a real tmpfs the test mounts
(root, or CAP_SYS_ADMIN; elsewhere skipped, with the reason). Each test failed before its fix:
a failed snapshot left its chunks behind and `ciuic gc` could not take its lock on the full
disk; prune and gc retried a read-only file system three times in a long line that never said
"read-only", and reindex reported success."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ciuic import SnapshotManager
from tests.models import model_opt


def _mount(disk: Path, size: str) -> None:
    disk.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                              capture_output=True, text=True, timeout=30)
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs ({e}): this test needs mount(8)")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({done.stderr.strip()}): this test needs root")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of its own (4 MiB), to fill or to make read-only."""
    where = tmp_path / "disk"
    _mount(where, "4m")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def ciuic(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ciuic", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def test_a_read_only_store_is_said_at_once_and_reindex_fails(disk: Path) -> None:
    store = disk / "store"
    model, opt = model_opt(64, 64)
    with SnapshotManager("p", job="j", store=store, compression="off") as m:
        for step in range(4):
            m.save(step, model, opt)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, timeout=30)
    for args in (["prune", "p/j", "--keep-last", "1"], ["gc"]):
        run = ciuic(store, *args)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, (args, run.stderr)
        assert "read-only file system; remount it read-write" in lines[0], lines
        assert "attempt" not in lines[0] and lines[0].count(str(disk)) == 1, lines
    assert re.search(r"p/j +4 +3 ", ciuic(store, "ls").stdout)  # nothing was pruned
    run = ciuic(store, "reindex")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "read-only file system" in run.stderr and "nothing was written" in run.stderr
    assert "indexed" not in run.stdout

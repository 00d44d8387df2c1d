from __future__ import annotations

from pathlib import Path

from rich.console import Console

from ciuic.demo import run_demo


def test_demo_kills_resumes_and_is_bit_identical(tmp_path: Path) -> None:
    console = Console(file=open(tmp_path / "out.txt", "w"), width=120)  # noqa: SIM115
    result = run_demo(str(tmp_path / "store"), steps=60, save_every=10, kill_at=27,
                      console=console)
    console.file.close()
    text = (tmp_path / "out.txt").read_text()
    assert result.interrupted_rc == -9
    assert result.resumed_from == 20
    assert result.identical
    assert result.reference["digest"] == result.resumed["digest"]
    assert "Detected training interruption" in text and "Resuming training at step 21" in text
    assert "Bit-identical" in text

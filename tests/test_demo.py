from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from ciuic.chain.repo import Repository
from ciuic.demo import run_demo


def test_demo_kills_resumes_and_is_bit_identical(tmp_path: Path) -> None:
    console = Console(file=open(tmp_path / "out.txt", "w"), width=120)  # noqa: SIM115
    result = run_demo(str(tmp_path / "store"), steps=60, save_every=10, kill_at=27,
                      console=console)
    console.file.close()
    text = (tmp_path / "out.txt").read_text()
    assert result.interrupted_rc == -9
    # The snapshot of step 20 is taken in the background: on a loaded machine the kill 7 steps
    # later can come before its commit, and then the job rightly resumes from step 10.
    assert result.resumed_from in (10, 20)
    # ... but it resumes from the latest snapshot the killed run committed: were there a later
    # one, the resumed run would have written its step again.
    with Repository.open(str(tmp_path / "store")) as repo:
        steps = [s.step for s in repo.catalog.snapshots("demo", result.job)]  # commit order
    assert steps == sorted(set(steps)), steps
    assert result.resumed_from in steps
    assert result.identical
    assert result.reference["digest"] == result.resumed["digest"]
    assert "Detected training interruption" in text
    assert f"Resuming training at step {result.resumed_from + 1}" in text
    assert "Bit-identical" in text
    # the command the summary prints to train the job further by hand resumes it
    assert " ".join(result.again) in " ".join(text.split())
    again = subprocess.run(result.again, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    # the finished run ended with its final state in the chain (step 59): nothing is redone
    assert "Resuming training at step 60" in again.stderr


def _training(marker: str) -> dict[int, str]:
    """pid -> command line of the demo's training processes whose command line has marker."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "ciuic.demo.train" in cmd and marker in cmd:
                found[int(entry.name)] = cmd
    return found


def test_a_sigterm_to_the_demo_stops_its_training_processes_too(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    demo = subprocess.Popen([sys.executable, "-m", "ciuic", "--store", store, "demo",
                             "--steps", "2000", "--kill-at", "1900"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(children := _training(store)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(children) == 2, children  # the reference run and the run with snapshots
        scratch = {Path(c.split("--result ")[1].split()[0]).parent for c in children.values()}
        os.kill(demo.pid, signal.SIGTERM)  # to the demo alone, not its process group
        assert demo.wait(timeout=60) == 128 + signal.SIGTERM
        assert not _training(store)
        assert not any(p.exists() for p in scratch)
    finally:
        demo.kill()
        for pid in _training(store):
            os.kill(pid, signal.SIGKILL)


def test_the_command_the_demo_prints_is_the_readmes() -> None:
    """With the default store and interval, the demo's "train it further" command is the one
    the README shows (a user saw two different commands)."""
    from ciuic.demo import SAVE_EVERY, _again

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    printed = _again(".ciuic", "<job>", 400, SAVE_EVERY, default_store=True)
    assert " ".join(["-m", *printed[2:]]) in readme
    assert "--store" in _again("/tmp/s", "<job>", 400, SAVE_EVERY, default_store=False)
    assert "--save-every" in _again(".ciuic", "<job>", 400, 10, default_store=True)


def test_two_ctrl_c_stop_the_demo_training_with_one_line(tmp_path: Path) -> None:
    """The first SIGINT asks for an emergency snapshot; a second one before it is done stops
    the script at once: exit 130 and a line that says how to resume, not a traceback."""
    train = subprocess.Popen(
        [sys.executable, "-m", "ciuic.demo.train", "--store", str(tmp_path / "store"),
         "--job", "twice", "--steps", "5000", "--save-every", "1000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "CIUIC_FAILPOINTS": "body.put=sleep:3"})  # a slow snapshot
    try:
        stream = train.stderr
        assert stream is not None
        seen: list[str] = []

        def until(text: str) -> None:
            for line in stream:
                seen.append(line)
                if text in line:
                    return

        until("starting from scratch")  # the manager is set up: a SIGINT is now its to handle
        train.send_signal(signal.SIGINT)
        until("SIGINT received")
        time.sleep(1)  # inside the emergency snapshot (its body's write sleeps 3 s)
        train.send_signal(signal.SIGINT)
        _, rest = train.communicate(timeout=120)
    finally:
        train.kill()
    err = "".join(seen) + rest
    assert train.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "interrupted; run the same command again to resume" in err, err[-3000:]

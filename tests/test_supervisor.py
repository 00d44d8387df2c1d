"""``ciuic run``: restarts after a kill and a hang (bit-exact), causes, giving up, preemption,
the host-memory tier (same bytes as the store; nothing leaks when the supervisor is killed),
and no false hang while a snapshot is written."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ciuic import knobs
from ciuic.chain.repo import Repository
from ciuic.supervisor.causes import OomWatch, classify, exception_line
from tests.framework_runs import free_port

HELPER = Path(__file__).parent / "helpers" / "sup_train.py"
CIUIC = [sys.executable, "-m", "ciuic"]


def supervise(tmp: Path, *args: str, run_args: tuple[str, ...] = (), env: dict[str, str] | None
              = None, timeout: float = 240, torchrun: int = 0) -> subprocess.CompletedProcess[str]:
    command = [sys.executable]
    if torchrun:
        command += ["-m", "torch.distributed.run", "--nproc_per_node", str(torchrun),
                    "--master_port", str(free_port()), "--max-restarts", "0"]
    return subprocess.run(
        [*CIUIC, "run", *run_args, "--", *command, str(HELPER), "--store", str(tmp / "store"),
         "--out", str(tmp / "out"), *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})


def reference(tmp: Path, *args: str, torchrun: int = 0) -> dict[str, torch.Tensor]:
    """The same job, uninterrupted and unsupervised."""
    command = [sys.executable]
    if torchrun:
        command += ["-m", "torch.distributed.run", "--nproc_per_node", str(torchrun),
                    "--master_port", str(free_port())]
    run = subprocess.run([*command, str(HELPER), "--store", str(tmp / "ref-store"), "--out",
                          str(tmp / "ref"), *args], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return final(tmp / "ref")


def final(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "final-ciuic.safetensors"))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ


def runs_of(tmp: Path) -> list[tuple[str | None, int | None, str | None]]:
    repo = Repository.open(tmp / "store")
    try:
        return [(r.cause, r.restart, r.end_kind) for r in repo.catalog.runs("sup", "default")]
    finally:
        repo.close()


def test_a_kill_then_a_hang_are_restarted_and_the_job_ends_bit_exact(tmp_path: Path) -> None:
    ref = reference(tmp_path, "--steps", "20", "--every", "5")
    run = supervise(tmp_path, "--steps", "20", "--every", "5", "--kill-at", "7:0",
                    "--hang-at", "13:1", run_args=("--hang-timeout", "2", "--grace", "1"))
    err = run.stderr
    assert run.returncode == 0, err[-4000:]
    assert_same(final(tmp_path / "out"), ref)
    # one line per interruption, naming the cause and the last step() seen
    assert "ciuic run: the job stopped at step 6: signal: SIGKILL (killed). Restart 1" in err
    assert re.search(r"ciuic run: the job stopped at step 12: hang: no step\(\) for 2 s \(pid "
                     r"\d+\)\. Restart 2", err), err[-4000:]
    detected = float(re.search(r"detected ([\d.]+) s after its last sign of training",
                               err).group(1))  # type: ignore[union-attr]
    assert 2.0 <= detected < 2.0 + 3.0
    # the recovery log's first line names the cause and where the job really stopped
    assert "Detected training interruption at step 6 (signal: SIGKILL (killed))" in err
    assert re.search(r"Detected training interruption at step 12 \(hang: no step\(\) for 2 s",
                     err)
    # the second restart came back from host memory: the snapshot at step 10
    assert re.search(r"Found snapshot at step 10.*\n\[INFO\] Loading snapshot from host memory",
                     err), err[-4000:]
    assert re.search(r"Read 0\.\d\d MiB from host memory and 0 B from the store", err)
    assert "the job finished (exit 0) after 2 restarts" in err
    causes = runs_of(tmp_path)
    assert [c[1] for c in causes] == [None, 1, 2]
    assert causes[0][0] == "signal: SIGKILL (killed)"
    assert (causes[1][0] or "").startswith("hang: no step() for 2 s")
    assert causes[2] == (None, 2, "clean")
    # `ciuic log` says where each interruption happened and why
    shown = subprocess.run([*CIUIC, "log", "sup/default"], capture_output=True, text=True,
                           env={**os.environ, "CIUIC_HOME": str(tmp_path / "store"),
                                "COLUMNS": "400"})
    assert "stopped at step 6: signal: SIGKILL (killed); resumed by run" in shown.stdout
    assert "(restart 1 by ciuic run)" in shown.stdout
    assert "stopped at step 12: hang: no step() for 2 s" in shown.stdout


def test_a_job_that_fails_at_start_up_stops_after_the_limit_and_says_why(tmp_path: Path) -> None:
    run = supervise(tmp_path, "--fail-start",
                    run_args=("--max-stalls", "3", "--backoff", "0.1", "--hang-timeout", "5"))
    err = run.stderr
    assert run.returncode == 1, err[-3000:]
    assert len(re.findall(r"^Traceback", err, re.M)) == 3  # three starts, no fourth
    assert ("ciuic run: giving up: it failed 3 times in a row without committing a new "
            "snapshot. The last failure, before its first step(): exception: RuntimeError: the "
            "data set is not mounted (injected start-up failure)") in err
    assert "Restart 1 of at most 10 in 0.1 s" in err and "Restart 2 of at most 10 in 0.2 s" in err


def test_sigterm_to_the_supervisor_takes_an_emergency_snapshot_and_does_not_restart(
        tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*CIUIC, "run", "--", sys.executable, str(HELPER), "--store", str(tmp_path / "store"),
         "--out", str(tmp_path / "out"), "--steps", "100000", "--every", "50",
         "--step-sleep", "0.01"], stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # until the job trains
        lines.append(line)
        if "Resuming training" in line or "starting from scratch" in line:
            break
    time.sleep(1.5)
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(60) == 128 + signal.SIGTERM, rest
    err = "".join(lines) + rest
    assert "ciuic run: SIGTERM received: passing it on to the job" in err
    assert re.search(r"Emergency snapshot at step (\d+) saved", err), err[-3000:]
    assert "after SIGTERM: not restarted" in err and "Restart" not in err
    step = int(re.search(r"Emergency snapshot at step (\d+)", err).group(1))  # type: ignore[union-attr]
    repo = Repository.open(tmp_path / "store")
    latest = repo.catalog.latest("sup", "default")
    assert latest is not None and latest.step == step
    assert [r.end_kind for r in repo.catalog.runs("sup", "default")] == ["signal:SIGTERM"]
    repo.close()


def _restore_dump(tmp: Path, env: dict[str, str]) -> tuple[dict[str, torch.Tensor], str]:
    """A process that restores the job and writes what it restored."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(HELPER.parent)!r})
from torch import nn
from safetensors.torch import save_file
from ciuic import SnapshotManager
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
m = SnapshotManager("sup", store={str(tmp / "store")!r}, save_interval=None)
m.restore(model, opt)
from finalstate import write_final
write_final(model, opt, __import__("pathlib").Path(sys.argv[1]))
import os; os._exit(0)  # like a crash: the host copy stays as it is
"""
    out = tmp / f"restored-{len(list(tmp.glob('restored-*')))}.safetensors"
    run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True,
                         text=True, env={**os.environ, **env}, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    from safetensors.torch import load_file

    return load_file(str(out)), run.stderr


def test_a_restore_from_host_memory_gives_the_bytes_of_the_store(tmp_path: Path) -> None:
    from ciuic.supervisor.channel import ENV
    from ciuic.supervisor.holder import Holder

    holder = Holder(budget=1 << 30)  # this test is the supervisor
    try:
        env = {**holder.environment(), "CIUIC_RUN_RESTART": "0"}
        run = subprocess.run([sys.executable, str(HELPER), "--store", str(tmp_path / "store"),
                              "--out", str(tmp_path / "out"), "--steps", "6", "--every", "5"],
                             capture_output=True, text=True, env={**os.environ, **env})
        assert run.returncode == 0, run.stderr[-3000:]
        copies = holder.copies()
        assert list(copies) == [0] and copies[0][1] == 5 and copies[0][2] >= 3 * 128 * 1024
        from_memory, said = _restore_dump(tmp_path, env)
        assert "Loading snapshot from host memory" in said, said[-2000:]
        # every chunk from memory, the small leaves' too (they share an arena)
        assert re.search(r"Read 0\.41 MiB from host memory and 0 B from the store", said), said
        from_store, said = _restore_dump(tmp_path, {ENV: ""})
        assert "host memory" not in said
        assert_same(from_memory, from_store)
        # damage in host memory: every chunk is checked, and a bad one comes from the store
        region = _map_first_buffer(holder)
        region[100:108] = b"\xff" * 8
        damaged, said = _restore_dump(tmp_path, env)
        assert re.search(r"Read 0\.\d\d MiB from host memory and 0\.[1-9]\d MiB from the store",
                         said), said[-2000:]
        assert_same(damaged, from_store)
    finally:
        holder.close()


def _map_first_buffer(holder: object) -> memoryview:
    import mmap

    rank = holder._ranks[0]  # type: ignore[attr-defined]
    b = rank.buffers[rank.ids[0]]
    return memoryview(mmap.mmap(b.fd, b.nbytes))


def _ours() -> set[int]:
    """This test process and its descendants (other jobs on the machine, another test run's
    supervisors among them, are not this test's to judge)."""
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():  # "pid (comm) state ppid ...": comm may hold spaces
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1]
                                              .split()[1])
        except (OSError, IndexError, ValueError):
            continue
    ours, grew = {os.getpid()}, True  # (the test process may map an earlier test's own)
    while grew:
        more = {pid for pid, parent in parents.items() if parent in ours} - ours
        ours |= more
        grew = bool(more)
    return ours


def _memfds(name: str = "ciuic", pids: set[int] | None = None) -> list[str]:
    """Every memfd of ciuic's that a process still holds or maps: any on this machine, or
    those of ``pids``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or (pids is not None and int(proc.name) not in pids):
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(f"/memfd:{name}"):
                    found.append(f"{proc.name}: {target}")
            found += [f"{proc.name}: {line.split()[-2]}" for line in
                      (proc / "maps").read_text().splitlines() if f"/memfd:{name}" in line]
        except OSError:
            continue
    return found


def test_a_killed_supervisor_leaks_no_shared_memory(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*CIUIC, "run", "--", sys.executable, str(HELPER), "--store", str(tmp_path / "store"),
         "--out", str(tmp_path / "out"), "--steps", "100000", "--every", "20",
         "--step-sleep", "0.01"], stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"})
    deadline = time.monotonic() + 60
    held: list[str] = []
    while time.monotonic() < deadline and not any(f"{proc.pid}: /memfd:ciuic:" in h
                                                  for h in held):
        time.sleep(0.2)
        held = _memfds(pids=_ours())
    assert any(f"{proc.pid}: /memfd:ciuic:" in h for h in held), held
    children = {int(h.split(":")[0]) for h in held if not h.startswith(f"{proc.pid}:")} - {
        os.getpid()}  # (the test process may map an earlier test's memfds: no child)
    assert children  # the training process maps its staging buffers
    proc.kill()  # SIGKILL: nothing of the supervisor's runs after this
    proc.wait()
    deadline = time.monotonic() + 60  # the job gets SIGTERM, snapshots and exits
    while time.monotonic() < deadline and any(Path(f"/proc/{c}").exists() for c in children):
        time.sleep(0.2)
    assert not any(Path(f"/proc/{c}").exists() for c in children)
    # nothing the supervisor started holds one (an orphan would keep its pid: it is checked)
    assert _memfds(pids=(_ours() - {os.getpid()}) | children | {proc.pid}) == []
    assert not [p for p in Path("/dev/shm").iterdir() if "ciuic" in p.name]


def test_a_slow_save_with_fast_training_is_no_hang(tmp_path: Path) -> None:
    run = supervise(tmp_path, "--steps", "8", "--every", "4", "--sync",
                    run_args=("--hang-timeout", "1", "--grace", "1"),
                    # each chunk object's write, or the one pack's: past the hang timeout
                    env={"CIUIC_FAILPOINTS":
                         f"chunk.put=sleep:{1.1 if knobs.get().pack_bytes else 0.4}"})
    assert run.returncode == 0, run.stderr[-3000:]
    longest = float(re.search(r"longest snapshot: ([\d.]+) s", run.stderr).group(1))  # type: ignore[union-attr]
    assert longest > 1.0  # longer than the hang timeout, inside step()
    assert "no step()" not in run.stderr and "Restart" not in run.stderr
    repo = Repository.open(tmp_path / "store")
    try:
        info = repo.catalog.latest("sup", "default")
        assert info is not None and info.step == 7
    finally:
        repo.close()


# -- causes, from what the kernel, Python and torchrun print -------------------------------------

TORCHRUN_TAIL = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_10:00:00
  host      : node7
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================"""


def test_causes_are_told_apart() -> None:
    assert str(classify(-signal.SIGKILL, [], None)) == "signal: SIGKILL (killed)"
    assert str(classify(-signal.SIGSEGV, [], None)) == "signal: SIGSEGV (killed)"
    assert str(classify(137, [], None)) == "signal: SIGKILL (exit 137)"
    assert str(classify(1, TORCHRUN_TAIL.splitlines(), None)) == "signal: rank 1: SIGKILL (killed)"
    tail = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
            "    boom()", "[rank0]: ValueError: loss is NaN at step 12"]
    assert str(classify(1, tail, None)) == "exception: ValueError: loss is NaN at step 12"
    assert exception_line(tail + TORCHRUN_TAIL.splitlines()) == (
        "ValueError: loss is NaN at step 12")
    assert str(classify(3, ["bye"], None)) == "exit status 3, last stderr line: bye"


def test_the_oom_killer_is_named_with_its_evidence(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 0\n")
    watch = OomWatch()
    watch.sources = {f"cgroup {events}": events}
    watch.before = {f"cgroup {events}": 0}
    assert str(classify(-signal.SIGKILL, [], watch)) == "signal: SIGKILL (killed)"
    events.write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 1\n")  # as the kernel counts
    assert str(classify(-signal.SIGKILL, [], watch)) == (
        f"oom: killed by the kernel's OOM killer (cgroup {events} oom_kill 0 -> 1)")
    assert str(classify(-signal.SIGTERM, [], watch)) == "signal: SIGTERM (killed)"
    assert OomWatch().sources  # this machine lets at least /proc/vmstat be read


def test_host_memory_budget_parses_and_refuses_nonsense() -> None:
    from ciuic.cli.run import host_memory_budget
    from ciuic.errors import ConfigurationError

    assert host_memory_budget("64G") == 64 << 30
    assert host_memory_budget("512MiB") == 512 << 20
    assert host_memory_budget("off") is None and host_memory_budget("0") is None
    assert 0 < host_memory_budget("50%") < os.sysconf("SC_PAGE_SIZE") * os.sysconf(  # type: ignore[operator]
        "SC_PHYS_PAGES")
    for bad in ("lots", "150%", "-3G"):
        with pytest.raises(ConfigurationError, match="--host-memory"):
            host_memory_budget(bad)


def test_over_its_budget_the_host_copy_is_released_and_training_goes_on(tmp_path: Path) -> None:
    run = supervise(tmp_path, "--steps", "8", "--every", "4", "--kill-at", "6:0",
                    run_args=("--host-memory", "200K", "--hang-timeout", "30"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "host-memory copy released: the host copy would hold" in run.stderr
    assert "over its budget of" in run.stderr and "Loading snapshot from host memory" not in (
        run.stderr)
    assert "the job finished (exit 0) after 1 restart" in run.stderr


def test_ciuic_run_needs_a_command() -> None:
    run = subprocess.run([*CIUIC, "run"], capture_output=True, text=True)
    assert run.returncode == 2
    assert "ciuic run needs the command to run" in run.stderr


def test_ciuic_run_refuses_a_misspelt_option_instead_of_running_it() -> None:
    """Issue 42: ``--hang-timeot`` was run as the command ("cannot start --hang-timeot") and
    reported as a failed job. Options before the command are click's: an unknown one is refused
    with a suggestion; what follows ``--`` or the first word that is not an option is the
    command, its options its own."""
    typo = subprocess.run([*CIUIC, "run", "--hang-timeot", "5", "--", "true"],
                          capture_output=True, text=True)
    assert typo.returncode == 2, typo.stderr
    assert "No such option '--hang-timeot'" in typo.stderr and "--hang-timeout" in typo.stderr
    assert "cannot start" not in typo.stderr
    for args in (["--hang-timeout", "5", "--"], ["--hang-timeout", "5"]):
        ran = subprocess.run([*CIUIC, "run", *args, "echo", "-n", "--said", "--", "it"],
                             capture_output=True, text=True)
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout == "--said -- it"


@pytest.mark.slow
def test_under_torchrun_one_rank_killed_then_hung_restarts_the_whole_job(tmp_path: Path) -> None:
    ref = reference(tmp_path, "--steps", "20", "--every", "5", torchrun=2)
    run = supervise(tmp_path, "--steps", "20", "--every", "5", "--kill-at", "7:0:1",
                    "--hang-at", "13:1:1", run_args=("--hang-timeout", "3", "--grace", "2"),
                    torchrun=2, timeout=400)
    err = run.stderr
    assert run.returncode == 0, err[-5000:]
    assert_same(final(tmp_path / "out"), ref)
    # torchrun's own report names the rank that was killed
    assert re.search(r"ciuic run: the job stopped at step \d+: signal: rank 1: SIGKILL", err), (
        err[-5000:])
    assert re.search(r"hang: no step\(\) for 3 s \(rank 1, pid \d+\)", err)
    assert "the job finished (exit 0) after 2 restarts" in err
    repo = Repository.open(tmp_path / "store")
    try:  # every rank resumed from the same snapshot: one restore event per start, rank 0's
        events = [e for e in repo.catalog.events("sup", "default", limit=1000)
                  if e.kind == "restore"]
        assert len(events) == 2
        runs = repo.catalog.runs("sup", "default")
        assert [r.restart for r in runs] == [None, 1, 2]
    finally:
        repo.close()


def _memory_cgroup(tmp_name: str, limit: int) -> tuple[Path, Path] | None:
    """A new memory cgroup limited to ``limit`` bytes: (its folder, its cgroup.procs), or None
    where this machine does not let us make one (not root, no memory controller)."""
    for root, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                             (Path("/sys/fs/cgroup"), "memory.max")):
        folder = root / tmp_name
        try:
            folder.mkdir()
        except OSError:
            continue
        try:
            (folder / limit_file).write_text(str(limit))
            if (folder / "memory.swappiness").exists():  # v1: no swapping instead of the kill
                (folder / "memory.swappiness").write_text("0")
            return folder, folder / "cgroup.procs"
        except OSError:
            folder.rmdir()
    return None


def test_the_kernels_oom_killer_is_named_with_its_evidence(tmp_path: Path) -> None:
    made = _memory_cgroup(f"ciuic-test-{os.getpid()}", 400 << 20)
    if made is None:
        pytest.skip("this machine does not let the test make a memory cgroup")
    folder, procs = made
    try:
        job = "x = bytearray(2 << 30)  # zero-filled: every page is touched"
        run = subprocess.run(
            ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *CIUIC, "run",
             "--max-stalls", "1", "--host-memory", "off", "--", sys.executable, "-c", job],
            capture_output=True, text=True, timeout=120)
        err = run.stderr
        assert run.returncode == 128 + signal.SIGKILL, err[-3000:]
        assert re.search(r"giving up: .*The last failure, before its first step\(\): oom: "
                         r"killed by the kernel's OOM killer \(cgroup \S+ oom_kill 0 -> 1\)",
                         err), err[-3000:]
    finally:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                folder.rmdir()
                break
            except OSError:  # its last process is still exiting
                time.sleep(0.2)


def test_the_servers_snapshot_listing_says_where_runs_stopped_and_why(tmp_path: Path) -> None:
    from tests.serverutil import new_key, serve

    store = tmp_path / "server-store"
    key = new_key(store, "sup", "writer")
    with serve(store, tmp_path / "server.log") as url:
        run = supervise(tmp_path, "--steps", "10", "--every", "4", "--kill-at", "6:0",
                        "--endpoint", url, env={"CIUIC_API_KEY": key})
        assert run.returncode == 0, run.stderr[-3000:]
        import httpx

        body = httpx.get(f"{url}/v1/projects/sup/jobs/default/snapshots",
                         headers={"Authorization": f"Bearer {key}"}).json()
    notes = [n for s in body["snapshots"] for n in s["notes"]]
    assert any(re.search(r"then run \w+ stopped at step [56]: signal: SIGKILL \(killed\)", n)
               for n in notes), notes
    assert any(re.search(r"resumed by run \w+ \(restart 1 by ciuic run\)", n) for n in notes)


def test_a_generations_cause_that_arrives_after_the_next_one_started_is_said_then(
        caplog: pytest.LogCaptureFixture) -> None:
    """torchrun restarted the workers (new processes in the heartbeat slots) before this
    node's ciuic run had any cause for the stop: it says the cause is not known yet, and names
    it once torchrun's line for the failed worker arrives (it said 'not known' for good)."""
    import logging

    from ciuic.supervisor import beat
    from ciuic.supervisor.agent import Supervisor
    from ciuic.supervisor.holder import Holder
    from ciuic.supervisor.starts import Options, Start

    holder = Holder(budget=None)
    sup = Supervisor(Options(["true"]))
    start = Start(0, time.monotonic())
    workers = [subprocess.Popen(["sleep", "120"]) for _ in range(4)]

    def poll(pids: list[int]) -> None:
        for slot, pid in enumerate(pids):
            beat.Beacon(holder.beats, slot, slot, pid).step(6)
        beats = beat.read(holder.beats)
        sup._note(start, beats)
        alive = {w.pid for w in workers if w.poll() is None}
        sup._workers(start, beats, alive, holder, time.monotonic())

    try:
        with caplog.at_level(logging.WARNING, logger="ciuic.run"):
            poll([workers[0].pid, workers[1].pid])  # generation 1
            first = workers[0].pid
            for w in workers[:2]:
                w.kill()
                w.wait()
            poll([workers[2].pid, workers[3].pid])  # generation 2, before any cause
            said = caplog.text
            assert ("the workers stopped at step 6: the cause is not known yet" in said
                    and "(generation 2)" in said), said
            assert holder.restart is not None and not holder.restart["cause"]
            sup._failed.append(f"[default0]: failed (exitcode: -9) local_rank: 0 (pid: {first})")
            poll([workers[2].pid, workers[3].pid])
        assert ("the cause of the workers' stop at step 6 (the end of generation 1): rank 0: "
                "SIGKILL (killed)" in caplog.text), caplog.text  # (its rank: seen in generation 1)
        assert holder.restart["cause"] == "rank 0: SIGKILL (killed)"
        assert start.unknown is None
    finally:
        for w in workers:
            w.kill()
            w.wait()
        holder.close()


def test_a_worker_that_aborted_after_a_peer_died_names_the_peers_cause() -> None:
    """gloo aborts a worker in its teardown (SIGABRT) after a collective failed because a rank
    of another node was killed: that node's cause is named, not this node's abort; a signal
    sent to a worker (SIGKILL) is this node's own cause; an abort with no word from another
    node is named as it is."""
    from ciuic.supervisor.agent import Supervisor
    from ciuic.supervisor.holder import Holder
    from ciuic.supervisor.peers import Node
    from ciuic.supervisor.starts import Options

    holder = Holder(budget=None)
    sup = Supervisor(Options(["true"]))
    try:
        now = time.monotonic()
        sup._failed.append("[default1]: failed (exitcode: -6) local_rank: 1 (pid: 4242)")
        assert sup._worker_cause([], set(), holder, now) == (
            "local rank 1: SIGABRT (killed)", "exit")
        holder.peer_causes[1] = (Node(1, "10.0.0.2", 7000), "rank 3: SIGKILL (killed)", now)
        assert sup._worker_cause([], set(), holder, now) == (
            "node 1 (10.0.0.2): rank 3: SIGKILL (killed)", "peer")
        sup._failed.append("[default0]: failed (exitcode: -9) local_rank: 0 (pid: 4241)")
        assert sup._worker_cause([], set(), holder, now) == (
            "local rank 0: SIGKILL (killed)", "signal")
    finally:
        holder.close()


def test_a_worker_that_lost_its_peer_is_a_consequence_and_waits_for_the_cause(
        caplog: pytest.LogCaptureFixture) -> None:
    """A worker whose exception says gloo lost its connection to another rank ("[rank2]: ...
    Connection closed by peer", as torch prints an uncaught exception in a process group)
    failed because of another rank: its exit is named only after a failure of this node's
    that is not one (whatever torchrun listed first) and after another node's word, and a node
    of several waits 30 s for that word, not 8 as for an exit of its own."""
    import logging

    from ciuic.supervisor import beat
    from ciuic.supervisor.agent import Supervisor
    from ciuic.supervisor.holder import Holder
    from ciuic.supervisor.peers import Node
    from ciuic.supervisor.starts import Options, Start

    holder = Holder(budget=None)
    sup = Supervisor(Options(["true"]))
    workers = [subprocess.Popen(["sleep", "120"]) for _ in range(2)]
    try:
        for slot, w in enumerate(workers):
            beat.Beacon(holder.beats, slot, 2 + slot, w.pid).step(7)
        beats = beat.read(holder.beats)
        now = time.monotonic()
        lines = [
            "[rank2]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] "
            "Connection closed by peer [10.0.0.1]:18647. This is typically caused by a remote "
            "worker crashing.",
            f"[default0]: failed (exitcode: 1) local_rank: 0 (pid: {workers[0].pid})"]
        from ciuic.supervisor import causes

        # torchrun's output, read as the agent reads it
        proc = subprocess.Popen(["sh", "-c", 'printf "%s\\n" "$@" >&2', "sh", *lines],
                                stderr=subprocess.PIPE)
        causes.forward(proc, sup._tail, sup._failed)
        proc.wait()
        assert len(sup._failed) == 2
        assert sup._worker_cause(beats, set(), holder, now) == (
            "rank 2: exit status 1 after its connection to another rank was lost", "lost")
        # any other library's lost connection (a data loader's HTTP read) is the worker's own
        assert not causes.PEER_LOST.search(
            "[rank0]: ConnectionResetError: [Errno 104] Connection reset by peer")
        assert causes.PEER_LOST.search(
            "[rank1]:[E1204 10:00:00.000 ProcessGroupNCCL.cpp:1] ncclRemoteError: remote "
            "process exited or there was a network error")
        # an exit of this node's own, listed after it, comes first
        sup._failed.append(f"[default1]: failed (exitcode: 1) local_rank: 1 (pid: "
                           f"{workers[1].pid})")
        assert sup._worker_cause(beats, set(), holder, now) == ("rank 3: exit status 1", "exit")
        sup._failed.pop()

        # several nodes: the consequence waits past 8 s for the other node's word
        holder._nodes = [Node(0, "10.0.0.1", 7000), Node(1, "10.0.0.2", 7000)]
        start = Start(0, now)
        sup._note(start, beats)
        alive = {w.pid for w in workers}
        with caplog.at_level(logging.WARNING, logger="ciuic.run"):
            sup._workers(start, beats, alive, holder, now)  # generation 1 seen
            workers[0].kill()
            workers[0].wait()
            alive = {workers[1].pid}
            sup._workers(start, beats, alive, holder, now + 0.1)
            sup._workers(start, beats, alive, holder, now + 9.0)
            assert "the workers stopped" not in caplog.text, caplog.text
            holder.peer_causes[0] = (Node(0, "10.0.0.1", 7000), "rank 0: exit status 1",
                                     now + 9.5)
            sup._workers(start, beats, alive, holder, now + 10.0)
        assert ("the workers stopped at step 7: node 0 (10.0.0.1): rank 0: exit status 1. "
                "torchrun restarts them (generation 2)" in caplog.text), caplog.text
        assert holder.cause is None  # the other node's cause: not this node's to give
    finally:
        for w in workers:
            w.kill()
            w.wait()
        holder.close()


class _NodeOfTwo:
    """``ciuic run``'s agent on node 1 of two (no pings: the tests set the other node's word),
    one start, and ``n`` sleeping processes as workers; :meth:`poll` shows the agent the
    worker ``pid`` in heartbeat slot 0 (rank 2) at ``step``, at the monotonic time ``at``."""

    def __init__(self, n: int, step: int) -> None:
        from ciuic.supervisor.agent import Supervisor
        from ciuic.supervisor.holder import Holder
        from ciuic.supervisor.peers import Node
        from ciuic.supervisor.starts import Options, Start

        self.holder = Holder(budget=None)
        self.holder._nodes = [Node(0, "10.0.0.1", 7000), Node(1, "10.0.0.2", 7000)]
        self.sup = Supervisor(Options(["true"]))
        self.start = Start(0, time.monotonic())
        self.workers = [subprocess.Popen(["sleep", "120"]) for _ in range(n)]
        self.step = step

    def poll(self, pid: int, at: float) -> None:
        from ciuic.supervisor import beat

        beat.Beacon(self.holder.beats, 0, 2, pid).step(self.step)
        beats = beat.read(self.holder.beats)
        self.sup._note(self.start, beats)
        alive = {w.pid for w in self.workers if w.poll() is None}
        self.sup._workers(self.start, beats, alive, self.holder, at)

    def close(self) -> None:
        for w in self.workers:
            w.kill()
            w.wait()
        self.holder.close()


@pytest.mark.parametrize("word", [True, False], ids=["word", "none"])
def test_a_new_generation_before_the_other_nodes_word_defers_a_lost_peer(
        caplog: pytest.LogCaptureFixture, word: bool) -> None:
    """torchrun restarted the workers while this node only knows that its worker lost its
    connection to another rank: it says the cause is not known yet, names the other node's
    cause once that arrives, and names the lost connection only after ``CAUSE_WAIT_S``
    without one."""
    import logging

    from ciuic.supervisor.peers import Node
    from ciuic.supervisor.starts import CAUSE_WAIT_S

    node = _NodeOfTwo(2, step=9)
    holder, sup, workers, poll = node.holder, node.sup, node.workers, node.poll
    now = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="ciuic.run"):
            poll(workers[0].pid, now)
            workers[0].kill()
            workers[0].wait()
            sup._failed.extend([
                "[rank2]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc"
                ":534] Connection reset by peer [10.0.0.1]:40321",
                f"[default0]: failed (exitcode: -6) local_rank: 0 (pid: {workers[0].pid})"])
            poll(workers[1].pid, now + 3)  # generation 2, before any word
            assert ("the workers stopped at step 9: the cause is not known yet (this node's "
                    "workers only lost their connection to another rank" in caplog.text)
            poll(workers[1].pid, now + 5)
            assert "the cause of the workers' stop" not in caplog.text, caplog.text
            if word:
                holder.peer_causes[0] = (Node(0, "10.0.0.1", 7000), "rank 0: exit status 1",
                                         now + 6)
                poll(workers[1].pid, now + 6.5)
                said = "node 0 (10.0.0.1): rank 0: exit status 1"
            else:
                poll(workers[1].pid, now + 3 + CAUSE_WAIT_S)
                said = "rank 2: SIGABRT (killed) after its connection to another rank was lost"
                assert holder.cause is None  # not a cause for the other nodes to repeat
        assert (f"the cause of the workers' stop at step 9 (the end of generation 1): {said}"
                in caplog.text), caplog.text
    finally:
        node.close()


def test_each_generation_is_named_by_its_own_failed_worker(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two generations fail in turn on a node of several: the first's cause is said when
    torchrun restarts the workers, and the second is named by its own worker's line, not the
    first's, which torchrun printed earlier."""
    import logging

    node = _NodeOfTwo(3, step=5)
    sup, workers, poll = node.sup, node.workers, node.poll
    now = time.monotonic()

    def fail(w: subprocess.Popen[bytes], code: int) -> None:
        w.kill()
        w.wait()
        sup._failed.append(f"[default0]: failed (exitcode: {code}) local_rank: 0 (pid: {w.pid})")

    try:
        with caplog.at_level(logging.WARNING, logger="ciuic.run"):
            poll(workers[0].pid, now)
            fail(workers[0], 1)
            poll(workers[0].pid, now + 1)  # gone: an exit waits for another node's word
            poll(workers[1].pid, now + 3)  # torchrun restarted them first
            assert ("the workers stopped at step 5: rank 2: exit status 1. torchrun restarts "
                    "them (generation 2)" in caplog.text), caplog.text
            fail(workers[1], 2)
            poll(workers[1].pid, now + 5)
            poll(workers[1].pid, now + 14)
        assert ("the workers stopped at step 5: rank 2: exit status 2. torchrun restarts them "
                "(generation 3)" in caplog.text), caplog.text
    finally:
        node.close()


def test_torchrun_exiting_after_a_node_was_lost_passes_on_the_loss_not_its_exit(
        caplog: pytest.LogCaptureFixture) -> None:
    """Several nodes: the workers stopped because node 1 was lost (said at once), and torchrun
    then exited before any worker of the next generation trained (torch 2.13's agents with a
    shared rendezvous store: ``DistStoreError`` after 60 s). The start's cause, which the
    restarted job records and logs, is the node's loss; torchrun's exit is what followed. Once
    a later generation trained, a failure is its own cause."""
    import logging

    from ciuic.supervisor import beat
    from ciuic.supervisor.agent import Supervisor, first_cause
    from ciuic.supervisor.holder import Holder
    from ciuic.supervisor.peers import Node
    from ciuic.supervisor.starts import Options, Start

    holder = Holder(budget=None)
    sup = Supervisor(Options(["true"]))
    start = Start(0, time.monotonic())
    workers = [subprocess.Popen(["sleep", "120"]) for _ in range(2)]
    gone = ("node 1 (10.0.0.2): its ciuic run is gone (the node is down, or ciuic run was "
            "killed)")
    exited = classify(1, ["Traceback (most recent call last):", "  File \"x\", line 1",
                          "torch.distributed.DistStoreError: wait timeout after 60000ms"], None)
    try:
        for slot, w in enumerate(workers):
            beat.Beacon(holder.beats, slot, slot, w.pid).step(12)
        sup._note(start, beat.read(holder.beats))
        sup._workers(start, beat.read(holder.beats), {w.pid for w in workers}, holder,
                     time.monotonic())
        holder.trouble[1] = (Node(1, "10.0.0.2", 7000), gone.split(": ", 1)[1],
                             time.monotonic())
        for w in workers:
            w.kill()
            w.wait()
        with caplog.at_level(logging.WARNING, logger="ciuic.run"):
            sup._workers(start, beat.read(holder.beats), set(), holder, time.monotonic())
        # one numbering of restarts: the line names the number the restarted run records
        # (``ciuic log``: "restart 1 by ciuic run"), torchrun's or ciuic run's alike
        assert (f"the workers stopped at step 12: {gone}. torchrun restarts them (generation 2)"
                ", as restart 1" in caplog.text), caplog.text
        # (counted once the next generation starts: torchrun may exit instead)
        assert holder.restart is not None and holder.restart["number"] == 1
        assert sup.restarts == 0
        start.cause = exited
        first_cause(start, beat.read(holder.beats), peered=True)
        assert str(start.cause) == gone and start.then == exited
        # one node: torchrun's report of its worker is the cause, as it was
        start.cause, start.then = exited, None
        first_cause(start, beat.read(holder.beats), peered=False)
        assert start.cause == exited and start.then is None
        # a worker of the next generation trained: its failure is a cause of its own
        holder.trouble.clear()  # (the replacement answers)
        nxt = [subprocess.Popen(["sleep", "120"]) for _ in range(2)]
        workers.extend(nxt)
        for slot, w in enumerate(nxt):
            beat.Beacon(holder.beats, slot, slot, w.pid).step(14)
        sup._workers(start, beat.read(holder.beats), {w.pid for w in nxt}, holder,
                     time.monotonic())
        assert start.generation == 2 and sup.restarts == 1
        first_cause(start, beat.read(holder.beats), peered=True)
        assert start.cause == exited
    finally:
        for w in workers:
            w.kill()
            w.wait()
        holder.close()


def test_a_torchrun_without_restarts_left_is_not_said_to_restart_its_workers(
        caplog: pytest.LogCaptureFixture) -> None:
    """CI, slow suite: under ``torchrun --max-restarts 0`` a killed rank was said to be
    restarted by torchrun ("generation 2, as restart 1") and counted; torchrun exited instead,
    ciuic run restarted the job as restart 2, and the restarted job saw CIUIC_RUN_RESTART=2.
    The line says torchrun has no restarts left, and a restart counts once it happens."""
    import logging

    from ciuic.cli.run import torchrun_restarts
    from ciuic.supervisor import beat
    from ciuic.supervisor.agent import Supervisor
    from ciuic.supervisor.holder import Holder
    from ciuic.supervisor.starts import Options, Start

    py = [sys.executable, "-m", "torch.distributed.run"]
    assert torchrun_restarts([*py, "--nproc_per_node", "2", "train.py"]) == 0
    assert torchrun_restarts(["torchrun", "--max-restarts", "3", "train.py"]) == 3
    assert torchrun_restarts(["torchrun", "--max_restarts=5", "t.py", "--max-restarts", "9"]) == 5
    assert torchrun_restarts(["python", "train.py", "--max-restarts", "3"]) is None
    for left, said in ((0, "(torchrun has no restarts left: --max-restarts 0)"),
                       (2, ". torchrun restarts them (generation 2), as restart 1")):
        holder = Holder(budget=None)
        sup = Supervisor(Options(["torchrun"], worker_restarts=left))
        start = Start(0, time.monotonic())
        workers = [subprocess.Popen(["sleep", "120"]) for _ in range(2)]
        try:
            for slot, w in enumerate(workers):
                beat.Beacon(holder.beats, slot, slot, w.pid).step(7)
            sup._note(start, beat.read(holder.beats))
            sup._workers(start, beat.read(holder.beats), {w.pid for w in workers}, holder,
                         time.monotonic())
            workers[1].kill()
            workers[1].wait()
            sup._failed.append("[W] torch.distributed.elastic.multiprocessing.api: failed "
                               f"(exitcode: -9) local_rank: 1 (pid: {workers[1].pid}) of binary")
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="ciuic.run"):
                sup._workers(start, beat.read(holder.beats), {workers[0].pid}, holder,
                             time.monotonic())
            assert "the workers stopped at step 7: rank 1: SIGKILL" in caplog.text, caplog.text
            assert said in caplog.text, caplog.text
            assert sup.restarts == 0  # not yet: torchrun exits, or restarts them
        finally:
            for w in workers:
                w.kill()
                w.wait()
            holder.close()

"""The asynchronous engine: a true snapshot, reused staging memory, busy policies, budget."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ciuic import SnapshotManager, StateHolder, faults, knobs
from ciuic.engine.own_thread import OwnThread
from ciuic.state.capture import capture
from ciuic.store.local import LocalStore
from ciuic.threads import lower_priority
from tests.models import model_opt_stepped


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def setup(width: int = 256) -> tuple[nn.Module, torch.optim.Optimizer]:
    return model_opt_stepped(width, width, 4, batch=2, optimizer=torch.optim.Adam, lr=0.01)


def test_snapshot_holds_the_values_of_the_call_not_later_ones(store_dir: Path) -> None:
    model, opt = setup()
    extra = {"ema": torch.arange(1000.0)}
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_steps = [st["step"].clone() for st in opt.state.values()]
    faults.reload("chunk.put=sleep:0.05")  # keep the background write busy
    with SnapshotManager("p", job="torn", store=store_dir) as m:
        assert m.step(0, model, opt, ema=StateHolder(extra))
        # training goes on at once and changes everything in place
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        for st in opt.state.values():
            st["step"].add_(100)
            st["exp_avg"].mul_(0)
        extra["ema"].zero_()
        m.wait()
        faults.reload("")
        assert m.stats.failures == 0
        fresh, fresh_opt = setup()
        holder = StateHolder({})
        assert m.restore(fresh, fresh_opt, ema=holder) == 0
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want_model[k]), k
    assert [st["step"].item() for st in fresh_opt.state.values()] == [s.item() for s in
                                                                      want_steps]
    assert torch.equal(holder.state["ema"], torch.arange(1000.0))


def test_staging_buffers_are_allocated_once_and_reused(store_dir: Path) -> None:
    model, opt = setup()
    with SnapshotManager("p", job="reuse", store=store_dir, save_interval=1) as m:
        m.step(0, model, opt)
        m.wait()
        ptrs = {p: b.data_ptr() for p, b in m._pipeline.staging._buffers.items()}
        size = m._pipeline.staging.allocated_bytes
        for s in range(1, 5):
            m.step(s, model, opt)
        m.wait()
        assert {p: b.data_ptr() for p, b in m._pipeline.staging._buffers.items()} == ptrs
        assert m._pipeline.staging.allocated_bytes == size
        assert m.stats.last_stall_s > 0 and m.stats.snapshots == 5


def test_buffers_are_allocated_before_the_first_snapshot_is_due(store_dir: Path) -> None:
    model, opt = setup()
    with SnapshotManager("p", job="ahead", store=store_dir, save_interval=10) as m:
        assert not m.step(1, model, opt)  # not due: the buffers are allocated in the background
        m.wait()
        ahead = {p: b.data_ptr() for p, b in m._pipeline.staging._buffers.items()}
        paths = {leaf.path for leaf in capture(model, opt, {}).leaves}
        assert set(ahead) == paths  # every tensor of the state, parameters and Adam's moments
        assert m._pipeline.staging.reserve_s > 0
        for s in range(2, 11):
            m.step(s, model, opt)
        m.wait()
        assert m.stats.snapshots == 1 and m.stats.failures == 0
        assert {p: b.data_ptr() for p, b in m._pipeline.staging._buffers.items()} == ahead
        fresh, fresh_opt = setup()
        fresh[0].weight.data.zero_()
        assert m.restore(fresh, fresh_opt) == 10
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_reserving_never_touches_a_snapshot_in_flight(store_dir: Path) -> None:
    model, opt = setup()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    faults.reload("chunk.put=sleep:0.05")  # the first snapshot is still being written ...
    try:
        with SnapshotManager("p", job="inflight", store=store_dir, save_interval=2) as m:
            assert m.step(0, model, opt)
            assert not m.step(1, model, opt)  # ... when the first non-due step reserves
            m.wait()
            faults.reload("")
            assert m.stats.failures == 0
            fresh, fresh_opt = setup()
            assert m.restore(fresh, fresh_opt) == 0
    finally:
        faults.reload("")
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_reserving_respects_the_staging_budget(store_dir: Path) -> None:
    model, opt = setup()
    with SnapshotManager("p", job="tight", store=store_dir, save_interval=10,
                         staging_budget_bytes=1024) as m:
        m.step(1, model, opt)
        m.wait()
        assert m._pipeline.staging.allocated_bytes == 0


_MEMORY_RUN = """
import json, sys
import torch
from ciuic import SnapshotManager
from tests.test_engine import rss_bytes, setup

model, opt = setup(width=1024)  # about 12.6 MiB of weights and Adam state
state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
# raw chunks: whether "auto" compresses depends on the disk probe of the day, and with the
# codec on the writer threads' malloc arenas settle about 17 MiB higher once (not a leak:
# docs/benchmarks.md, "compression=auto on this VM"), which is not what this test measures
with SnapshotManager("p", job="mem", store=sys.argv[1], save_interval=1, keep_last=2,
                     compression="off") as m:
    samples = []
    for s in range(50):
        with torch.no_grad():
            model[0].weight.add_(0.001)  # new bytes every snapshot
        m.step(s, model, opt)
        if s in (9, 49):
            m.wait()
            samples.append(rss_bytes())
    m.wait()
    print(json.dumps({"snapshots": m.stats.snapshots, "failures": m.stats.failures,
                      "allocated": m._pipeline.staging.allocated_bytes,
                      "state_bytes": state_bytes, "growth": samples[1] - samples[0]}))
"""


def test_host_memory_stays_flat_across_50_async_snapshots(store_dir: Path) -> None:
    """In a fresh interpreter: what earlier tests left in this process (threads, heap
    fragmentation) is not the manager's memory."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", _MEMORY_RUN, str(store_dir)], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["snapshots"] == 50 and r["failures"] == 0
    assert r["allocated"] <= 1.1 * r["state_bytes"]
    growth = r["growth"]
    assert growth < 0.5 * r["state_bytes"], f"RSS grew {growth / 2**20:.1f} MiB over 40 snapshots"


def test_skip_policy_never_waits_and_counts(store_dir: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    model, opt = setup()
    faults.reload("chunk.put=sleep:0.2")
    with caplog.at_level(logging.WARNING, logger="ciuic"), SnapshotManager(
            "p", job="skip", store=store_dir, save_interval=1, on_busy="skip") as m:
        started = [m.step(s, model, opt) for s in range(5)]
        faults.reload("")
        m.wait()
        assert started[0] and not any(started[1:])
        assert m.stats.skipped == 4 and m.stats.waited_s == 0
    assert "skipped: the previous one is still being written" in caplog.text


def test_wait_policy_takes_every_snapshot_and_says_so(store_dir: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    model, opt = setup()
    faults.reload("chunk.put=sleep:0.05")
    with caplog.at_level(logging.WARNING, logger="ciuic"), SnapshotManager(
            "p", job="wait", store=store_dir, save_interval=1) as m:
        assert all(_changed(model) and m.step(s, model, opt) for s in range(3))
        faults.reload("")
        m.wait()
        assert m.stats.snapshots == 3 and m.stats.waited_s > 0
    assert "waited" in caplog.text and "snapshots are due faster than they are written" in \
        caplog.text


def _changed(model: nn.Module) -> nn.Module:
    """``model`` with every parameter changed (each snapshot writes every chunk again)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model


def test_a_wait_for_the_first_snapshot_alone_is_no_warning(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The process's first snapshot pays once for buffers, probes and every chunk: the next
    one due while it is written says nothing of the rate (the README's quick start warned)."""
    model, opt = setup()
    faults.reload("chunk.put=sleep:0.1")
    try:
        with caplog.at_level(logging.WARNING, logger="ciuic"), SnapshotManager(
                "p", job="first", store=store_dir, save_interval=1) as m:
            for step in range(2):  # the second waits for the first
                m.step(step, _changed(model), opt)
            assert m.stats.waited_s > 0.05
            assert "due faster than they are written" not in caplog.text
            m.step(2, _changed(model), opt)  # waits for the second: now it is the rate
            assert "due faster than they are written" in caplog.text
    finally:
        faults.reload("")


def test_state_over_the_budget_is_written_synchronously(store_dir: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    model, opt = setup()
    with caplog.at_level(logging.WARNING, logger="ciuic"), SnapshotManager(
            "p", job="budget", store=store_dir, staging_budget_bytes=1024) as m:
        info = m.save(0, model, opt)
        assert m._pipeline.staging.allocated_bytes == 0
    assert "over the budget of 1024" in caplog.text
    with SnapshotManager("p", job="budget", store=store_dir) as m2:
        fresh, fresh_opt = setup()
        with torch.no_grad():
            fresh[0].weight.zero_()
        assert m2.restore(fresh, fresh_opt) == info.step
        assert torch.equal(fresh[0].weight, model[0].weight)


def _buffer_ptrs(m: SnapshotManager) -> dict[str, int]:
    return {p: b.data_ptr() for p, b in m._pipeline.staging._buffers.items()}


def test_restore_reads_the_model_into_its_own_tensors_not_the_staging_buffers(
        store_dir: Path) -> None:
    """A model on the CPU takes the snapshot's bytes in its own memory (restore/inplace.py):
    no staging buffer is lent to the restore, and nothing restored aliases one, so the next
    snapshot (which stages into them) changes no restored value."""
    model, opt = setup()
    ema = {"w": torch.arange(64.0)}
    with SnapshotManager("p", job="reuse", store=store_dir) as m:
        m.save(1, model, opt, ema=StateHolder(ema))
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = [{k: v.clone() for k, v in st.items()} for st in opt.state.values()]

    fresh, fresh_opt = setup(256)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    where = {k: v.data_ptr() for k, v in fresh.state_dict().items()}
    holder = StateHolder({})
    with SnapshotManager("p", job="reuse", store=store_dir) as m:
        assert m.restore(fresh, fresh_opt, ema=holder) == 1
        m.wait()  # the buffers of the next snapshot, allocated after the restore: none lent
        lent = {b.untyped_storage().data_ptr() for b in m._pipeline.staging.buffers().values()}
        assert lent.isdisjoint(v.untyped_storage().data_ptr()
                               for v in fresh.state_dict().values())
        assert {k: v.data_ptr() for k, v in fresh.state_dict().items()} == where
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, want_model[k]), k
        for st, want in zip(fresh_opt.state.values(), want_opt, strict=True):
            assert all(torch.equal(st[k], v) for k, v in want.items())
        # train on, snapshot: the staging buffers are allocated now, apart from the restored
        fresh(torch.randn(2, 256)).sum().backward()
        fresh_opt.step()
        after = [{k: v.clone() for k, v in st.items()} for st in fresh_opt.state.values()]
        m.save(2, fresh, fresh_opt, ema=holder)
        staged = {b.untyped_storage().data_ptr() for b in m._pipeline.staging._buffers.values()}
        kept = [holder.state["w"], *(v for st in fresh_opt.state.values() for v in st.values()),
                *fresh.state_dict().values()]
        assert staged and not {t.untyped_storage().data_ptr() for t in kept} & staged
        # nothing restored aliases a staging buffer: the snapshot did not change them
        assert torch.equal(holder.state["w"], torch.arange(64.0))
        for st, want in zip(fresh_opt.state.values(), after, strict=True):
            for k, v in want.items():
                assert torch.equal(st[k], v), k


def test_restore_over_the_staging_budget_reads_into_fresh_memory(store_dir: Path) -> None:
    model, opt = setup()
    with SnapshotManager("p", job="tight", store=store_dir) as m:
        m.save(1, model, opt)
    fresh, fresh_opt = setup(256)
    with SnapshotManager("p", job="tight", store=store_dir,
                         staging_budget_bytes=1024) as m:
        assert m.restore(fresh, fresh_opt) == 1
        assert m._pipeline.staging.allocated_bytes <= 1024
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_own_thread_runs_calls_on_one_named_thread_and_reentrant_calls_directly() -> None:
    import threading

    from ciuic.engine.own_thread import OwnThread

    own = OwnThread("ciuic-test-own")
    names = {own.run(lambda: threading.current_thread().name) for _ in range(3)}
    assert len(names) == 1 and next(iter(names)).startswith("ciuic-test-own")
    # a call made on that thread (as a finalizer it triggers) runs there at once, no deadlock
    inner = own.run(lambda: own.run(lambda: threading.current_thread().name))
    assert inner == next(iter(names))
    with pytest.raises(ZeroDivisionError):
        own.run(lambda: 1 / 0)


def _niceness_of_new_threads(before: set[threading.Thread]) -> dict[str, set[int]]:
    """The nice values of the ciuic threads started since ``before`` (the threads alive then;
    not their idents, which a thread started later may reuse), by name prefix."""
    seen: dict[str, set[int]] = {}
    for t in threading.enumerate():
        if t not in before and t.name.startswith("ciuic") and t.native_id is not None:
            prefix = t.name.rsplit("_", 1)[0]
            seen.setdefault(prefix, set()).add(os.getpriority(os.PRIO_PROCESS, t.native_id))
    return seen


def _wait_for_threads(before: set[threading.Thread], names: set[str]) -> dict[str, set[int]]:
    deadline = time.monotonic() + 10
    while True:
        seen = _niceness_of_new_threads(before)
        if names <= set(seen) or time.monotonic() > deadline:
            return seen
        time.sleep(0.02)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice: Linux")
@pytest.mark.parametrize("nice", [10, 0])
def test_background_threads_run_at_a_lower_cpu_priority(
        store_dir: Path, nice: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An asynchronous snapshot's threads run nicer than training; a synchronous save, which
    the caller waits for, runs at the caller's priority, its store calls included."""
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    low = min(19, base + nice)
    puts: list[tuple[str, int]] = []  # (thread name prefix, nice) of each chunk written
    put = LocalStore.put

    def recording(self: LocalStore, key: str, data: Any, **kw: Any) -> None:
        if key.startswith(("chunks/", "packs/")):
            puts.append((threading.current_thread().name.rsplit("_", 1)[0],
                         os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        put(self, key, data, **kw)

    monkeypatch.setattr(LocalStore, "put", recording)
    faults.reload("chunk.put=sleep:0.3")  # hold the writer mid-snapshot
    before = set(threading.enumerate())
    with knobs.override(background_nice=nice), SnapshotManager(
            "p", job="nice", store=store_dir, compression="off", save_interval=1) as m:
        own = OwnThread(f"ciuic-nice{nice}", lower_priority)  # the compression decider's kind
        own.run(lambda: None)
        assert m.step(0, state=StateHolder({"w": torch.randn(4096)}))
        threads = {"ciuic-snapshot", "ciuic-chunk", f"ciuic-nice{nice}"}
        seen = _wait_for_threads(before, threads)
        m.wait()
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
        assert all(seen.get(k) == {low} for k in threads), (base, seen)
        assert puts and set(puts) == {("ciuic-store-bg" if nice else "ciuic-store", low)}, puts

        puts.clear()
        before = set(threading.enumerate())
        saving = threading.Thread(target=m.save, args=(1,),
                                  kwargs={"state": StateHolder({"w": torch.randn(4096)})})
        saving.start()
        seen = _wait_for_threads(before, {"ciuic-chunk"})
        saving.join()
        assert m.latest().step == 1  # type: ignore[union-attr]
    assert seen.get("ciuic-chunk") == {base} and "ciuic-snapshot" not in seen, seen
    assert puts and set(puts) == {("ciuic-store", base)}, puts

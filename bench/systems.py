"""The systems bench/run.py measures side by side: torch.save, safetensors, DCP (two writer
threads, every file fsync'ed) and its asynchronous save, and ciuic with its variants. Each saves
one state into a fresh directory and restores it into one set of live tensors."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from measure import drop_caches, fsync_tree, release_freed_memory, staging_floor
from states import BenchState, changed, sync, tenth_changed

T = TypeVar("T")


class System:
    """One tool under test. ``save`` returns the stall (how long training was blocked); the
    caller times the whole call until durable."""

    def __init__(self, name: str, base: Path, state: BenchState, live: BenchState) -> None:
        self.name, self.state, self.objects = name, state.flat, state.objects
        self.trainable = state.trainable
        #: the live tensors a restore ends in (a training job's model and optimizer), and the
        #: objects that hold them
        self.live, self.live_objects = live.flat, live.objects
        self.device = next(iter(self.state.values())).device
        self.dir = base / name.replace(" ", "_").replace(".", "_")

    def into_live(self, loaded: dict[str, torch.Tensor]) -> None:
        """``load_state_dict``: copy what was loaded into the live tensors."""
        for k, v in loaded.items():
            self.live[k].copy_(v)
        sync(self.live)

    def fresh(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)

    def save(self) -> float:
        t0 = time.perf_counter()
        self._save()
        return time.perf_counter() - t0

    def _save(self) -> None:
        raise NotImplementedError

    def load(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TorchSave(System):
    def _save(self) -> None:
        path = self.dir / "state.pt"
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self) -> None:
        self.into_live(torch.load(self.dir / "state.pt", weights_only=True,
                                  map_location=self.device))


class Safetensors(System):
    def _save(self) -> None:
        from safetensors.torch import save_file

        save_file(self.state, str(self.dir / "state.safetensors"))
        fsync_tree(self.dir)

    def load(self) -> None:
        from safetensors.torch import load_file

        # load_file maps the file: the copy into the live tensors reads every byte
        self.into_live(load_file(str(self.dir / "state.safetensors"), device=str(self.device)))


def writer(path: Path) -> object:
    """DCP's fastest writer here: two threads, every file fsync'ed (``sync_files``)."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(path), thread_count=2, sync_files=True)


class DCP(System):
    def _save(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, storage_writer=writer(self.dir / "ckpt"))

    def load(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.live, checkpoint_id=str(self.dir / "ckpt"))  # in place
        sync(self.live)


class DCPAsync(DCP):
    def save(self) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        future = dcp.async_save(self.state, storage_writer=writer(self.dir / "ckpt"))
        stall = time.perf_counter() - t0
        future.result()
        return stall


class Ciuic(System):
    """ciuic as a training job uses it: ``restore()`` at the start (nothing to restore: it
    allocates the staging buffers in the background), then asynchronous ``step()``; the stall is
    the staging copy, ``wait()`` = durable.

    One manager per round (a fresh store, so the snapshot is full), ``keep_last=2``,
    snapshotting every other step: the measured snapshot is the first one. ``incremental``
    re-snapshots with 10 % of the tensors changed, ``later`` with every tensor changed (the
    steady state of a job whose optimizer updates every weight); ``rollbacks`` restores with the
    live manager (a rollback, as ``restore(snapshot="healthy")`` after a loss spike does):
    the latest snapshot, then the one before it, each from a cold page cache; ``load`` is the
    restart: a new manager's restore. Every restore ends in the live module's and optimizer's
    tensors, at the same addresses."""

    encryption = False
    compression = "auto"  # on a local disk "auto" decides not to compress
    health = True  # per-tensor statistics computed while hashing (the default)

    def __init__(self, name: str, base: Path, state: BenchState, live: BenchState) -> None:
        super().__init__(name, base, state, live)
        self.manager: Any = None
        self.basis: dict[str, dict[str, float]] = {}  # compression="auto": what it decided, why
        self.step = 0
        self.steady: dict[str, list[float]] = {
            "stall": [], "durable": [], "new_bytes": [], "reserve_s": [], "rollback": [],
            "rollback_previous": [], "restart_restore": [], "restart_open": [],
            "later_stall": [], "later_durable": [], "later_floor": [], "later_new_bytes": []}
        #: where each live tensor's memory is: a restore must leave it there
        self.pointers = {k: v.untyped_storage().data_ptr() for k, v in self.live.items()}

    def fresh(self) -> None:
        self.close()
        super().fresh()
        from ciuic import SnapshotManager

        m = SnapshotManager("bench", job="ref", store=self.dir, save_interval=2, keep_last=2,
                            handle_signals=False, encryption=self.encryption,
                            compression=self.compression, health=self.health)
        assert m.restore(*self.objects) is None  # a fresh start: buffers allocated ahead
        self.step = 1
        m.step(self.step, *self.objects)  # not due
        m.wait()
        self.steady["reserve_s"].append(m._pipeline.staging.reserve_s)
        self.manager = m

    def save(self) -> float:
        m = self.manager
        self.step += 1
        t0 = time.perf_counter()
        m.step(self.step, *self.objects)
        stall = time.perf_counter() - t0
        m.wait()
        self.basis = dict(m._pipeline.compression.basis)
        return stall

    def incremental(self) -> None:
        """10 % of the tensors change (the LoRA state: its adapters and their moments); measure
        the steady-state stall and the new bytes (the state is put back after, bit for bit, for
        the systems that follow)."""
        m = self.manager
        # LoRA's steady state is its third snapshot on: the frozen base found unchanged twice
        # is then watched for writes by the kernel, not compared (engine/written.py); each of
        # those snapshots changes the adapters anew
        warm = 0 if self.trainable is None else 2
        for k in range(warm + 1):
            self.step += 2
            with (tenth_changed(self.state) if self.trainable is None
                  else changed(self.state, names=self.trainable, by=1e-3 * (k + 1))):
                t0 = time.perf_counter()
                m.step(self.step, *self.objects)
                stall = time.perf_counter() - t0
                m.wait()
                durable = time.perf_counter() - t0
        self.steady["stall"].append(stall)
        self.steady["durable"].append(durable)
        self.steady["new_bytes"].append(m.latest().new_bytes)

    def later(self) -> None:
        """A later snapshot with every tensor changed since the last one, and the copy floor
        just before it (the buffers hold the last snapshot's bytes: none of them is equal)."""
        m = self.manager
        self.step += 2
        with changed(self.state, by=2e-3):  # not incremental()'s 1e-3: every byte differs
            release_freed_memory()
            self.steady["later_floor"].append(staging_floor(self.state))
            release_freed_memory()
            t0 = time.perf_counter()
            m.step(self.step, *self.objects)
            self.steady["later_stall"].append(time.perf_counter() - t0)
            m.wait()
            self.steady["later_durable"].append(time.perf_counter() - t0)
        self.steady["later_new_bytes"].append(m.latest().new_bytes)

    def rollbacks(self) -> None:
        """The live manager restores the latest snapshot, then the one before it."""
        m = self.manager
        previous = m.latest().parent
        for key, snapshot in (("rollback", None), ("rollback_previous", previous)):
            drop_caches()
            t0 = time.perf_counter()
            m.restore(*self.live_objects, snapshot=snapshot)
            sync(self.live)
            self.steady[key].append(time.perf_counter() - t0)
            self.check_pointers()
            m.wait()  # its check of the store's copies, read on the writer thread

    def load(self) -> None:
        from ciuic import SnapshotManager

        self.close()  # a restarted job: the writer is gone (else the reader would take over)
        t0 = time.perf_counter()
        m = SnapshotManager("bench", job="ref", store=self.dir, handle_signals=False)
        self.manager = m  # closed after the timing: its close waits for the staging buffers
        t1 = time.perf_counter()  # it allocates in the background after the restore
        m.restore(*self.live_objects)  # every digest verified; read into the live tensors
        sync(self.live)
        t2 = time.perf_counter()
        self.steady["restart_open"].append(t1 - t0)
        self.steady["restart_restore"].append(t2 - t1)
        self.check_pointers()

    def check_pointers(self) -> None:
        for k, v in self.live.items():  # the restore kept their memory, not only their values
            assert v.untyped_storage().data_ptr() == self.pointers[k], k

    def close(self) -> None:
        if self.manager is not None:
            # after a rollback the last step() is not the latest snapshot: no final one
            self.manager.close(final=False)
            self.manager = None


class CiuicEncrypted(Ciuic):
    """The same, with every object sealed (AES-256-GCM, keyed names)."""

    encryption = True


class CiuicNoHealth(Ciuic):
    """The same without snapshot health (``health=False``): what the statistics cost."""

    health = False


class CiuicNoWatch(Ciuic):
    """The same with the kernel's write watch off (knob ``write_watch``): every tensor found
    unchanged before is compared with its staging buffer again."""

    def _off(self, method: Callable[[], T]) -> T:
        from ciuic import knobs

        with knobs.override(write_watch=False):
            return method()

    def save(self) -> float:
        return self._off(super().save)

    def incremental(self) -> None:
        self._off(super().incremental)

    def later(self) -> None:
        self._off(super().later)


class CiuicCompressed(Ciuic):
    """The same, with float compression forced on (byte planes, ``ciuic.floatcodec``)."""

    compression = "on"

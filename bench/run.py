"""Snapshot benchmark: ciuic against torch.save, safetensors and torch.distributed.checkpoint.

    .venv/bin/python bench/run.py [--rounds 3] [--dir /tmp/ciuic-bench] [--quick]

Builds the reference state of ../shared/docs/PERFORMANCE.md ("GPT-like 1 GiB": 88 M fp32
parameters of a 5-layer, d=1024, 24k-vocab transformer plus Adam's two moments, seeded), then
measures, interleaving the systems round by round: the stall (how long the call blocks training),
the time until durable (fsync'ed), the cold time to restore into the live tensors (a model's
and optimizer's, allocated once: every system's load ends with the bytes in them, as a user's
restore does), the bytes written and the peak extra host memory; for ciuic also an incremental
snapshot with 10 % of the tensors changed. Prints min/median/max.
``--quick`` uses a 1/16-size state (for the test suite's smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

Fn = Callable[[], None]


def gpt_shapes(d: int, vocab: int, layers: int, extra: dict[str, tuple[int, ...]]
               ) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a GPT-like transformer: embeddings, ``extra``, then the blocks."""
    shapes: dict[str, tuple[int, ...]] = {"tok_emb": (vocab, d), **extra}
    for i in range(layers):
        shapes |= {f"h{i}.attn.qkv": (3 * d, d), f"h{i}.attn.proj": (d, d),
                   f"h{i}.mlp.fc": (4 * d, d), f"h{i}.mlp.proj": (d, 4 * d),
                   f"h{i}.ln1.weight": (d,), f"h{i}.ln2.weight": (d,)}
    return shapes


def reference_state(scale: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Model weights (std 0.02) plus Adam exp_avg / exp_avg_sq, as one flat dict."""
    g = torch.Generator().manual_seed(seed)
    d = 1024 // scale
    shapes = gpt_shapes(d, 24_000 // scale, 5, {"pos_emb": (1024, d), "ln_f.weight": (d,),
                                                "ln_f.bias": (d,)})
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        w = torch.randn(shape, generator=g) * 0.02
        state[f"model.{name}"] = w
        state[f"adam.exp_avg.{name}"] = torch.randn(shape, generator=g) * 1e-3
        state[f"adam.exp_avg_sq.{name}"] = torch.rand(shape, generator=g) * 1e-6
    return state


def h200_state(scale: int = 1, seed: int = 0, device: str = "cuda") -> dict[str, torch.Tensor]:
    """The H200 reference state of PERFORMANCE.md, about 5.6 GB at scale 1: a GPT-like model
    (d=3072, 3 layers, 24k vocabulary; 420 M parameters) as bf16 weights, fp32 master weights
    and Adam's two fp32 moments, 14 bytes per parameter, built on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    d = 3072 // scale
    shapes = gpt_shapes(d, 24_000 // scale, 3, {"pos_emb": (2048 // scale, d)})
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        master = torch.randn(shape, generator=g, device=device) * 0.02
        state[f"model.{name}"] = master.to(torch.bfloat16)
        state[f"master.{name}"] = master
        state[f"adam.exp_avg.{name}"] = torch.randn(shape, generator=g, device=device) * 1e-3
        state[f"adam.exp_avg_sq.{name}"] = torch.rand(shape, generator=g, device=device) * 1e-6
    return state


def sync(state: dict[str, torch.Tensor]) -> None:
    """Wait for the device (timings on a GPU end when its work has)."""
    if any(t.is_cuda for t in state.values()):
        torch.cuda.synchronize()


def disk_floor(base: Path, size: int) -> float:
    """The disk's raw write floor: ``size`` bytes in 64 MiB writes, then fsync (as dd does)."""
    path = base / "disk-floor.bin"
    block = b"\1" * (64 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = size
        while left > 0:
            f.write(block[:min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_caches() -> None:
    """Best effort: cold reads need root; otherwise reads are warm (said in the report)."""
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


class RssPeak:
    """Samples this process's RSS every few ms; ``extra`` is the peak over the start value."""

    def __init__(self) -> None:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class System:
    """One tool under test. ``save`` returns the stall (how long training was blocked); the
    caller times the whole call until durable."""

    def __init__(self, name: str, base: Path, state: dict[str, torch.Tensor],
                 live: dict[str, torch.Tensor]) -> None:
        self.name, self.state = name, state
        #: the live tensors a restore ends in (a training job's model and optimizer)
        self.live = live
        self.device = next(iter(state.values())).device
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


class DCP(System):
    def _save(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, checkpoint_id=str(self.dir / "ckpt"))
        fsync_tree(self.dir)

    def load(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.live, checkpoint_id=str(self.dir / "ckpt"))  # in place
        sync(self.live)


class DCPAsync(DCP):
    def save(self) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        future = dcp.async_save(self.state, checkpoint_id=str(self.dir / "ckpt"))
        stall = time.perf_counter() - t0
        future.result()
        fsync_tree(self.dir)
        return stall


def training_objects(state: dict[str, torch.Tensor]) -> tuple[torch.nn.Module,
                                                                 torch.optim.Optimizer]:
    """The state as a training job holds it, sharing its tensors (no copies): a module whose
    parameters are the ``model.*`` tensors, and Adam over the ``master.*`` tensors where there
    are (the H200 state: bf16 weights, fp32 master weights) or the module's, its moments the
    ``adam.*`` tensors (and a step count, as after a step)."""
    module = torch.nn.Module()
    for k, v in state.items():  # the master weights too: a job saves its module's
        if k.startswith(("model.", "master.")):
            module.register_parameter(k.replace(".", "_"), torch.nn.Parameter(v))
    names = [k[6:] for k in state if k.startswith("model.")]
    params = [module.get_parameter(f"master_{n}".replace(".", "_")) if f"master.{n}" in state
              else module.get_parameter(f"model_{n}".replace(".", "_")) for n in names]
    opt = torch.optim.Adam(params)
    for n, p in zip(names, params, strict=True):
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": state[f"adam.exp_avg.{n}"],
                        "exp_avg_sq": state[f"adam.exp_avg_sq.{n}"]}
    return module, opt


class Ciuic(System):
    """ciuic's asynchronous ``step()``: the stall is the staging copy; ``wait()`` = durable.

    One manager per round (a fresh store, so the snapshot is full), snapshotting every other
    step: its first ``step()`` takes no snapshot and allocates the staging buffers in the
    background, as a training job's first steps do (``reserve_s``: how long that took); the
    measured snapshot is the next. ``steady`` re-snapshots with 10 % of the tensors changed.
    The state goes in and comes back as a job's module and Adam optimizer
    (``training_objects``): the restore ends in the live tensors they hold."""

    encryption = False
    compression = "auto"  # on a local disk "auto" decides not to compress
    health = True  # per-tensor statistics computed while hashing (the default)

    def __init__(self, name: str, base: Path, state: dict[str, torch.Tensor],
                 live: dict[str, torch.Tensor]) -> None:
        super().__init__(name, base, state, live)
        self.manager: object = None
        self.basis: dict[str, dict[str, float]] = {}  # compression="auto": what it decided, why
        self.step = 0
        self.steady: dict[str, list[float]] = {"stall": [], "durable": [], "new_bytes": [],
                                                "reserve_s": []}
        #: where each live tensor's memory is: a restore must leave it there
        self.pointers = {k: v.untyped_storage().data_ptr() for k, v in live.items()}

    def fresh(self) -> None:
        self.close()
        super().fresh()
        from ciuic import SnapshotManager

        m = SnapshotManager("bench", job="ref", store=self.dir, save_interval=2,
                            handle_signals=False, encryption=self.encryption,
                            compression=self.compression, health=self.health)
        self.step = 1
        m.step(self.step, *training_objects(self.state))  # not due: buffers allocated ahead
        m.wait()
        self.steady["reserve_s"].append(m._pipeline.staging.reserve_s)
        self.manager = m

    def save(self) -> float:
        m = self.manager
        assert m is not None
        self.step += 1
        objects = training_objects(self.state)
        t0 = time.perf_counter()
        m.step(self.step, *objects)  # type: ignore[attr-defined]
        stall = time.perf_counter() - t0
        m.wait()  # type: ignore[attr-defined]
        self.basis = dict(m._pipeline.compression.basis)  # type: ignore[attr-defined]
        return stall

    def incremental(self) -> None:
        """10 % of the tensors change; measure the steady-state stall and the new bytes."""
        m = self.manager
        names = sorted(self.state)
        changed = {k: self.state[k] + 1e-3 for k in names[::10]}
        state = {**self.state, **changed}
        self.step += 2
        objects = training_objects(state)
        t0 = time.perf_counter()
        m.step(self.step, *objects)  # type: ignore[attr-defined]
        self.steady["stall"].append(time.perf_counter() - t0)
        m.wait()  # type: ignore[attr-defined]
        self.steady["durable"].append(time.perf_counter() - t0)
        latest = m.latest()  # type: ignore[attr-defined]
        self.steady["new_bytes"].append(latest.new_bytes)

    def load(self) -> None:
        from ciuic import SnapshotManager

        self.close()  # a restarted job: the writer is gone (else the reader would take over)
        model, opt = training_objects(self.live)
        with SnapshotManager("bench", job="ref", store=self.dir, handle_signals=False) as m:
            m.restore(model, opt)  # every digest verified; read into the live tensors
            sync(self.live)
        for k, v in self.live.items():  # the restore kept their memory, not only their values
            assert v.untyped_storage().data_ptr() == self.pointers[k], k

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()  # type: ignore[attr-defined]
            self.manager = None


class CiuicEncrypted(Ciuic):
    """The same, with every object sealed (AES-256-GCM, keyed names)."""

    encryption = True


class CiuicNoHealth(Ciuic):
    """The same without snapshot health (``health=False``): what the statistics cost."""

    health = False


class CiuicCompressed(Ciuic):
    """The same, with float compression forced on (byte planes, ``ciuic.floatcodec``)."""

    compression = "on"


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS, so that RSS peaks measure each system alone."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def staging_floor(state: dict[str, torch.Tensor]) -> float:
    """The stall's floor: copying the state into buffers allocated beforehand."""
    cuda = any(v.is_cuda for v in state.values())  # device -> pinned host, as ciuic stages
    buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda) for k, v in state.items()}
    for k, v in state.items():  # touch once, as reused buffers are
        buffers[k].copy_(v)
    sync(state)
    t0 = time.perf_counter()
    for k, v in state.items():
        buffers[k].copy_(v, non_blocking=cuda)
    sync(state)
    return time.perf_counter() - t0


def machine() -> dict[str, object]:
    """What the figures were measured on."""
    info: dict[str, object] = {"node": platform.node(), "cpus": os.cpu_count(),
                               "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def timed(fn: Fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summary(xs: list[float]) -> str:
    return f"{min(xs):6.3f} / {statistics.median(xs):6.3f} / {max(xs):6.3f}"


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="1/16-size state, 1 round")
    p.add_argument("--json", type=Path, default=None, help="also write results here")
    p.add_argument("--state", choices=["gpt1g", "h200"], default="gpt1g",
                   help="the CPU reference state (1 GiB fp32) or the H200 one (5.6 GB: bf16 "
                        "weights, fp32 master, Adam), built on --device")
    p.add_argument("--device", default=None,
                   help="where the state lives (default: cuda for h200, else cpu)")
    p.add_argument("--scale", type=int, default=None, help="divide the state's dimensions")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="stop after the round that would leave too little time for another "
                        "(for a run on a lent machine with a time limit; at least one round)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)  # keep the recovery log out of the table
    if not os.environ.get("CIUIC_ENCRYPTION_KEY"):
        from ciuic.format.crypto import generate_key_text

        os.environ["CIUIC_ENCRYPTION_KEY"] = generate_key_text()  # for the ciuic+aes system
    scale = a.scale or (4 if a.quick else 1)
    rounds = 1 if a.quick else a.rounds
    base = a.dir or Path(tempfile.mkdtemp(prefix="ciuic-bench-"))
    device = a.device or ("cuda" if a.state == "h200" else "cpu")
    state = (h200_state(scale, device=device) if a.state == "h200"
             else {k: v.to(device) for k, v in reference_state(scale).items()})
    live = {k: v.clone() for k, v in state.items()}  # allocated and touched once, as a model's
    size = nbytes(state)
    base.mkdir(parents=True, exist_ok=True)
    write_floor = disk_floor(base, size)
    print(f"disk write floor (64 MiB writes + fsync of the state's size): {write_floor:.3f} s")
    print(f"state: {len(state)} tensors, {size / 2**30:.3f} GiB; machine: {machine()}")
    systems: list[System] = [
        cls(name, base, state, live) for cls, name in (
            (TorchSave, "torch.save"), (Safetensors, "safetensors"), (DCP, "dcp.save"),
            (DCPAsync, "dcp.async_save"), (Ciuic, "ciuic"), (CiuicEncrypted, "ciuic+aes"),
            (CiuicCompressed, "ciuic+compress"), (CiuicNoHealth, "ciuic-nohealth"))]
    keys = ("stall", "durable", "load", "bytes", "extra_mem")
    results: dict[str, dict[str, list[float]]] = {s.name: {k: [] for k in keys} for s in systems}
    floor: list[float] = []
    started = time.monotonic()
    for r in range(rounds):
        elapsed = time.monotonic() - started
        if a.deadline_s is not None and r and elapsed + elapsed / r > a.deadline_s:
            print(f"stopping after {r} round(s): another would pass --deadline-s")
            break
        floor.append(staging_floor(state))
        for s in systems if r % 2 == 0 else list(reversed(systems)):
            release_freed_memory()
            with RssPeak() as mem:  # ciuic's staging buffers, allocated in fresh(), count
                s.fresh()
                t0 = time.perf_counter()
                stall = s.save()
                durable = time.perf_counter() - t0
            res = results[s.name]
            res["stall"].append(stall)
            res["durable"].append(durable)
            res["extra_mem"].append(mem.extra)
            res["bytes"].append(du(s.dir))
            if isinstance(s, Ciuic):  # each variant: compression off (auto), sealed, on
                s.incremental()
            drop_caches()
            res["load"].append(timed(s.load))
            s.close()
            shutil.rmtree(s.dir, ignore_errors=True)  # one state on disk at a time
    for s in systems:
        s.close()
    print(f"\nstaging floor (copy into preallocated buffers): {summary(floor)} s")
    print(f"\n{'system':<15} {'stall s':>24} {'durable s':>24} {'cold load s':>24}"
          f" {'bytes/state':>11} {'extra mem/state':>15}")
    for name, res in results.items():
        print(f"{name:<15} {summary(res['stall']):>24} {summary(res['durable']):>24} "
              f"{summary(res['load']):>24} {statistics.median(res['bytes']) / size:11.3f} "
              f"{statistics.median(res['extra_mem']) / size:15.3f}")
    variants = [s for s in systems if isinstance(s, Ciuic)]
    for v in variants:
        print(f"\n{v.name} incremental (10 % of tensors changed, buffers warm): stall "
              f"{summary(v.steady['stall'])} s, durable {summary(v.steady['durable'])} s, "
              f"new bytes {statistics.median(v.steady['new_bytes']) / size:.3f} of the state")
    ciuic = variants[0]
    for kind, basis in ciuic.basis.items():
        print(f"ciuic compression=auto, {kind}: " + ", ".join(f"{k} {v:.3g}"
                                                          for k, v in basis.items()))
    print(f"ciuic staging buffers allocated ahead of the first snapshot (background): "
          f"{summary(ciuic.steady['reserve_s'])} s")
    out: dict[str, object] = {"state_bytes": size, "rounds": len(floor), "results": results,
                              "state": a.state, "device": device, "disk_write_floor": write_floor,
                              "staging_floor": floor, "ciuic_incremental": ciuic.steady,
                              "incremental": {v.name: v.steady for v in variants},
                              "ciuic_auto_compression": ciuic.basis,
                              "machine": machine()}
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    if a.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])

"""Snapshot benchmark: ciuic against torch.save, safetensors and torch.distributed.checkpoint.

    .venv/bin/python bench/run.py [--rounds 3] [--dir /tmp/ciuic-bench] [--quick]

Builds the reference state of ../shared/docs/PERFORMANCE.md ("GPT-like 1 GiB": 88 M fp32
parameters of a 5-layer, d=1024, 24k-vocab transformer plus Adam's two moments, seeded), then
measures, interleaving the systems round by round, the time to save until durable (fsync'ed) and
the time to load back into fresh CPU tensors, and the bytes written. Prints min/median/max.
``--quick`` uses a 1/16-size state (for the test suite's smoke run).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

Fn = Callable[[], None]


def reference_state(scale: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Model weights (std 0.02) plus Adam exp_avg / exp_avg_sq, as one flat dict."""
    g = torch.Generator().manual_seed(seed)
    d, vocab, layers = 1024 // scale, 24_000 // scale, 5
    shapes: dict[str, tuple[int, ...]] = {"tok_emb": (vocab, d), "pos_emb": (1024, d),
                                          "ln_f.weight": (d,), "ln_f.bias": (d,)}
    for i in range(layers):
        shapes |= {f"h{i}.attn.qkv": (3 * d, d), f"h{i}.attn.proj": (d, d),
                   f"h{i}.mlp.fc": (4 * d, d), f"h{i}.mlp.proj": (d, 4 * d),
                   f"h{i}.ln1.weight": (d,), f"h{i}.ln2.weight": (d,)}
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        w = torch.randn(shape, generator=g) * 0.02
        state[f"model.{name}"] = w
        state[f"adam.exp_avg.{name}"] = torch.randn(shape, generator=g) * 1e-3
        state[f"adam.exp_avg_sq.{name}"] = torch.rand(shape, generator=g) * 1e-6
    return state


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


class System:
    def __init__(self, name: str, base: Path, state: dict[str, torch.Tensor]) -> None:
        self.name, self.state = name, state
        self.dir = base / name.replace(" ", "_").replace(".", "_")

    def fresh(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)

    def save(self) -> None:
        raise NotImplementedError

    def load(self) -> None:
        raise NotImplementedError


class TorchSave(System):
    def save(self) -> None:
        path = self.dir / "state.pt"
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self) -> None:
        torch.load(self.dir / "state.pt", weights_only=True)


class Safetensors(System):
    def save(self) -> None:
        from safetensors.torch import save_file

        save_file(self.state, str(self.dir / "state.safetensors"))
        fsync_tree(self.dir)

    def load(self) -> None:
        from safetensors.torch import load_file

        out = load_file(str(self.dir / "state.safetensors"))
        for t in out.values():  # load_file maps lazily: touch every byte
            t.sum()


class DCP(System):
    def save(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, checkpoint_id=str(self.dir / "ckpt"))
        fsync_tree(self.dir)

    def load(self) -> None:
        import torch.distributed.checkpoint as dcp

        target = {k: torch.empty_like(v) for k, v in self.state.items()}
        dcp.load(target, checkpoint_id=str(self.dir / "ckpt"))


class Ciuic(System):
    def __init__(self, name: str, base: Path, state: dict[str, torch.Tensor]) -> None:
        super().__init__(name, base, state)
        self.step = 0

    def save(self) -> None:
        from ciuic import SnapshotManager

        with SnapshotManager("bench", job="ref", store=self.dir, handle_signals=False,
                             save_interval=None) as m:
            self.step += 1
            m.save(self.step, state=_Holder(self.state))

    def load(self) -> None:
        from ciuic import SnapshotManager

        holder = _Holder({})
        with SnapshotManager("bench", job="ref", store=self.dir, handle_signals=False) as m:
            m.restore(state=holder)


class _Holder:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state


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
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)  # keep the recovery log out of the table
    scale = 4 if a.quick else 1
    rounds = 1 if a.quick else a.rounds
    base = a.dir or Path(tempfile.mkdtemp(prefix="ciuic-bench-"))
    state = reference_state(scale)
    size = nbytes(state)
    print(f"state: {len(state)} tensors, {size / 2**30:.3f} GiB; machine: {platform.node()} "
          f"{os.cpu_count()} cores, torch {torch.__version__}, python {platform.python_version()}")
    systems: list[System] = [TorchSave("torch.save", base, state),
                             Safetensors("safetensors", base, state),
                             DCP("dcp.save", base, state), Ciuic("ciuic", base, state)]
    results: dict[str, dict[str, list[float]]] = {s.name: {"save": [], "load": [], "bytes": []}
                                                  for s in systems}
    for r in range(rounds):
        for s in systems if r % 2 == 0 else reversed(systems):
            s.fresh()
            results[s.name]["save"].append(timed(s.save))
            results[s.name]["bytes"].append(du(s.dir))
            drop_caches()
            results[s.name]["load"].append(timed(s.load))
    print(f"\n{'system':<12} {'save+fsync s (min/med/max)':>28} {'load s (min/med/max)':>28}"
          f" {'bytes/state':>12}")
    for name, res in results.items():
        print(f"{name:<12} {summary(res['save']):>28} {summary(res['load']):>28} "
              f"{statistics.median(res['bytes']) / size:12.3f}")
    out: dict[str, object] = {"state_bytes": size, "rounds": rounds, "results": results,
                              "machine": {"node": platform.node(), "cpus": os.cpu_count()}}
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    if a.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])

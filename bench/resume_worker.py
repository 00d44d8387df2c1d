"""The processes of bench/resume.py (see there): ``setup`` writes the state three ways; ``ciuic``,
``torch.load`` and ``safetensors`` each resume it in a fresh interpreter, make the first step,
and print their phase times as one JSON line.

    python bench/resume_worker.py setup DIR WIDTH
    python bench/resume_worker.py ciuic|torch.load|safetensors DIR WIDTH

The clock starts in the parent, just before the spawn (``RESUME_T0``, ``time.time()``); the
phases end when: the interpreter runs this file's first line (``up``), ``import torch`` returns
(``torch``), ciuic's or safetensors' import returns (``lib``), the model and optimizer are built
(``built``), the manager is constructed (``manager``: the catalog opened, the run recorded, the
lease taken; the peers have none), the state is in the model and optimizer (``restored``) and
the first resumed step returned (``step``: forward, backward, ``opt.step()`` and, for ciuic,
``manager.step()``). Between the last two the worker digests the restored state, outside the
clock (``check_s`` is subtracted from the step): the parent compares it with the setup's digest.
``gc_s``: the time the garbage collector ran within the clock (its full collections: ``gc_full``,
which counts the digest's too).
"""

import gc
import time

T_UP = time.time()  # before every import: the interpreter's start-up counts
#: the cyclic garbage collector's time in this process, and its full collections (the more
#: objects the imports leave, the longer each full collection walks them)
GC = {"s": 0.0, "full": 0, "start": 0.0}


def _gc_timer(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        GC["start"] = time.perf_counter()
        return
    GC["s"] += time.perf_counter() - GC["start"]
    GC["full"] += info["generation"] == 2


gc.callbacks.append(_gc_timer)

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

LAYERS = 21
BATCH = 8
SAVED_STEP = 1  # the setup trains step 1 and snapshots it; a resume continues at step 2
PROJECT, JOB = "bench", "resume"


def build(width: int) -> tuple[Any, Any]:
    """The issue's module: ``nn.Sequential`` of 21 ``nn.Linear(width, width)`` and its Adam,
    seeded (the weights every process starts from before it loads the saved state)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(LAYERS)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: Any, opt: Any, seed: int, width: int) -> None:
    """One training step on a seeded batch."""
    import torch

    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


def digest(model: Any, opt: Any) -> str:
    """SHA-256 of every byte of the model's and the optimizer's state, in a fixed order."""
    import torch

    h = hashlib.sha256()

    def add(name: str, value: Any) -> None:
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().contiguous().cpu().reshape(-1)
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
        else:
            h.update(json.dumps(value, sort_keys=True).encode())

    for k, v in model.state_dict().items():
        add(k, v)
    sd = opt.state_dict()
    for i in sorted(sd["state"]):
        for k in sorted(sd["state"][i]):
            add(f"state.{i}.{k}", sd["state"][i][k])
    add("param_groups", sd["param_groups"])
    return h.hexdigest()


def paths(folder: Path) -> dict[str, Path]:
    return {"store": folder / "store", "torch": folder / "state.pt",
            "safetensors": folder / "state.safetensors"}


def _fsynced(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def setup(folder: Path, width: int) -> dict[str, Any]:
    """Train step 1, then write the state as a ciuic snapshot, a ``torch.save`` file and a
    safetensors file (each fsync'ed). Returns the digest and the sizes."""
    import torch
    from safetensors.torch import save_file

    from ciuic import SnapshotManager

    p = paths(folder)
    model, opt = build(width)
    train_step(model, opt, SAVED_STEP, width)
    manager = SnapshotManager(PROJECT, job=JOB, store=p["store"], save_interval=1000)
    info = manager.save(SAVED_STEP, model, opt)
    manager.close(final=False)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    with open(p["torch"], "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, entry in opt.state_dict()["state"].items():
        flat.update({f"opt.{i}.{k}": v for k, v in entry.items()})
    save_file(flat, str(p["safetensors"]),
              metadata={"param_groups": json.dumps(opt.state_dict()["param_groups"])})
    _fsynced(p["safetensors"])
    state_bytes = sum(v.numel() * v.element_size() for v in flat.values())
    return {"digest": digest(model, opt), "state_bytes": state_bytes,
            "ciuic_bytes": info.new_bytes, "torch_bytes": p["torch"].stat().st_size,
            "safetensors_bytes": p["safetensors"].stat().st_size}


def resume(system: str, folder: Path, width: int, t0: float) -> dict[str, Any]:
    """Resume in this fresh process as a user's script does; the phase times and digests."""
    p = paths(folder)
    t: dict[str, float] = {"up": T_UP}
    import torch

    t["torch"] = time.time()
    if system == "ciuic":
        from ciuic import SnapshotManager
    elif system == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file
    t["lib"] = time.time()
    model, opt = build(width)
    t["built"] = time.time()
    manager = None
    if system == "ciuic":
        manager = SnapshotManager(PROJECT, job=JOB, store=p["store"], save_interval=1000)
        t["manager"] = time.time()
        step = manager.restore(model, opt)
    elif system == "torch.load":
        t["manager"] = time.time()
        state = torch.load(p["torch"], map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = SAVED_STEP
        del state
    elif system == "safetensors":
        t["manager"] = time.time()
        flat = load_file(str(p["safetensors"]))
        with safe_open(str(p["safetensors"]), "pt") as f:
            groups = json.loads(f.metadata()["param_groups"])
        model.load_state_dict({k[6:]: v for k, v in flat.items() if k.startswith("model.")})
        opt_state: dict[int, dict[str, Any]] = {}
        for k, v in flat.items():
            if k.startswith("opt."):
                _, i, name = k.split(".", 2)
                opt_state.setdefault(int(i), {})[name] = v
        opt.load_state_dict({"state": opt_state, "param_groups": groups})
        step = SAVED_STEP
        del flat
    else:
        raise SystemExit(f"unknown system {system!r}: ciuic, torch.load or safetensors")
    t["restored"] = time.time()
    gc_before_check = GC["s"]
    c0 = time.perf_counter()
    restored_digest = digest(model, opt)  # outside the clock: subtracted from the step
    check_s = time.perf_counter() - c0
    gc_check = GC["s"] - gc_before_check
    if step != SAVED_STEP:
        raise SystemExit(f"{system}: resumed at step {step}, not {SAVED_STEP}")
    train_step(model, opt, SAVED_STEP + 1, width)
    if manager is not None:
        manager.step(SAVED_STEP + 1, model, opt)
    t["step"] = time.time()
    out = {"system": system, "t0": t0, "times": t, "check_s": check_s,
           "gc_s": GC["s"] - gc_check, "gc_full": GC["full"],
           "restored_digest": restored_digest, "stepped_digest": digest(model, opt)}
    if manager is not None:
        manager.close(final=False)  # the store keeps the one snapshot every round resumes
    return out


def main() -> None:
    system, folder, width = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    t0 = float(os.environ.get("RESUME_T0", T_UP))
    out = setup(folder, width) if system == "setup" else resume(system, folder, width, t0)
    print("RESUME-JSON " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""Models whose state dict is not simply their parameters, trained the same way in one process
(tests/test_state_hooks.py) and under FSDP2 on two ranks (this script, under torchrun; gloo,
CPU):

- ``fused``: a fused QKV projection whose state-dict hooks split ``wqkv`` into ``wq``/``wk``/
  ``wv`` on save and merge them on load (as torchtitan's ``FusedQKVLinear`` does);
- ``weight_norm`` and ``spectral_norm``: parametrizations (``parametrizations.weight.original0``,
  and a power iteration whose vectors ``_u``/``_v`` are buffers updated by every forward);
- ``tied``: an embedding and an output layer sharing one weight;
- ``compiled``: a ``torch.compile``d model (its state dict says ``_orig_mod.``).

    python -m torch.distributed.run --nproc-per-node 2 tests/helpers/hooked_models.py \
        STORE OUT KIND...

For each kind: train 3 steps, snapshot, train 2 more; then a model built from another seed
restores the snapshot and trains 1 step. Rank 0 writes OUT/KIND.safetensors: every rank's
parameters, buffers and optimizer state after that step, and after 4 uninterrupted steps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrizations


def replicated(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on every rank, still a DTensor (so the load can copy it into a
    sharded parameter), as torchtitan's hooks do; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(t, DTensor):
        return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)
    return t


class FusedQKV(nn.Module):
    """One ``wqkv`` weight, saved as ``wq``, ``wk``, ``wv`` (and merged again on load)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        return q * k.sigmoid() + v

    @staticmethod
    def _split(module: nn.Module, state: dict[str, Any], prefix: str, _: Any) -> None:
        for param in ("weight", "bias"):
            full = replicated(state.pop(f"{prefix}wqkv.{param}"))
            for name, part in zip(("wq", "wk", "wv"), full.chunk(3, dim=0), strict=True):
                state[f"{prefix}{name}.{param}"] = part.contiguous()

    @staticmethod
    def _merge(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        for param in ("weight", "bias"):
            keys = [f"{prefix}{name}.{param}" for name in ("wq", "wk", "wv")]
            if all(k in state for k in keys):
                parts = [replicated(state.pop(k)) for k in keys]
                state[f"{prefix}wqkv.{param}"] = torch.cat(parts, dim=0)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(x))))


KINDS: dict[str, Callable[[], nn.Module]] = {
    "fused": lambda: nn.Sequential(FusedQKV(), nn.Linear(8, 4)),
    "weight_norm": lambda: nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 8)),
                                         nn.Tanh(), nn.Linear(8, 4)),
    "spectral_norm": lambda: nn.Sequential(parametrizations.spectral_norm(nn.Linear(8, 8)),
                                           nn.Tanh(), nn.Linear(8, 4)),
    "tied": Tied,
    "compiled": lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)),
}


def build(kind: str, seed: int, shard: Callable[[nn.Module], None] | None = None
          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = KINDS[kind]()
    if shard is not None:
        shard(model)
    if kind == "compiled":  # the eager backend: the naming is what is tested, not inductor
        model = torch.compile(model, backend="eager")  # type: ignore[assignment]
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def train(kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, steps: range,
          rank: int = 0) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, 16, (4,), generator=g) if kind == "tied" else torch.randn(
            4, 8, generator=g)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def local(t: torch.Tensor) -> torch.Tensor:
    inner = t.to_local() if hasattr(t, "to_local") else t
    return inner.detach().clone().contiguous()


def tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Everything training depends on, as it is in memory (not through state-dict hooks)."""
    out = {f"param/{n}": local(p) for n, p in model.named_parameters()}
    out |= {f"buffer/{n}": local(b) for n, b in model.named_buffers()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for k, v in state.items():
            out[f"optimizer/{names[id(p)]}/{k}"] = local(v)
    return out


def resumed(kind: str, store: Path, rank: int = 0,
            shard: Callable[[nn.Module], None] | None = None) -> dict[str, torch.Tensor]:
    """Snapshot after 3 steps, 2 more, then another model restores it and makes step 4."""
    from ciuic import SnapshotManager

    model, optimizer = build(kind, 0, shard)
    with SnapshotManager("hooks", job=kind, store=store, handle_signals=False,
                         asynchronous=False) as m:
        train(kind, model, optimizer, range(3), rank)
        m.save(3, model, optimizer)
        train(kind, model, optimizer, range(3, 5), rank)
    model, optimizer = build(kind, 1, shard)
    with SnapshotManager("hooks", job=kind, store=store, handle_signals=False) as m:
        assert m.restore(model, optimizer) == 3
    if kind == "tied":
        inner: Any = model
        assert inner.head.weight is inner.embed.weight, "the restore untied the weights"
    train(kind, model, optimizer, range(3, 4), rank)
    return tensors(model, optimizer)


def uninterrupted(kind: str, rank: int = 0, shard: Callable[[nn.Module], None] | None = None
                  ) -> dict[str, torch.Tensor]:
    model, optimizer = build(kind, 0, shard)
    train(kind, model, optimizer, range(4), rank)
    return tensors(model, optimizer)


def broken(store: Path, out: Path, rank: int, shard: Callable[[nn.Module], None]) -> int:
    """Rank 1's state-dict hook raises at the snapshot of step 3: each rank writes OUT/broken-
    rankR.txt with the step at which its step() raised and the exception (or that none did,
    after 30 steps)."""
    from ciuic import SnapshotManager

    def fails(module: nn.Module, state: dict[str, Any], prefix: str, _: Any) -> None:
        if rank == 1:
            raise AttributeError("'Linear' object has no attribute 'wq'")

    model, optimizer = build("compiled", 0, shard)
    model._orig_mod[0].register_state_dict_post_hook(fails)
    said = "no exception"
    with SnapshotManager("hooks", job="broken", store=store, handle_signals=False,
                         save_interval=3) as m:
        try:
            for step in range(1, 31):
                train("compiled", model, optimizer, range(step, step + 1), rank)
                m.step(step, model, optimizer)
        except Exception as e:
            said = f"step {step}: {type(e).__name__}: {e}"
    (out / f"broken-rank{rank}.txt").write_text(said)
    return 0


def main() -> int:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    store, out, kinds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]  # or "broken"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))

    def shard(model: nn.Module) -> None:
        fully_shard(model, mesh=mesh)

    if kinds == ["broken"]:
        return broken(store, out, rank, shard)
    for kind in kinds:
        mine = {f"resumed/{k}": v for k, v in resumed(kind, store, rank, shard).items()}
        mine |= {f"reference/{k}": v for k, v in uninterrupted(kind, rank, shard).items()}
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, mine)
        if rank == 0:
            save_file({f"rank{r}/{k}": v for r, part in enumerate(parts) for k, v in part.items()},
                      str(out / f"{kind}.safetensors"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from leave import leave  # beside this script

    leave(main())  # not sys.exit: see tests/helpers/leave.py

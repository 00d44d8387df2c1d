"""The states bench/run.py snapshots, each as a flat dict of tensors (what the peers save) and
as the module and optimizer a training job holds (what ciuic snapshots), sharing memory.

- ``module`` (the default): the issue's "1 GiB reference state as a real module": an
  ``nn.Sequential`` of 21 ``nn.Linear(2048, 2048)`` (88 M fp32 parameters) with
  ``torch.optim.Adam`` (or AdamW) after one step: the weights and the two moments, 0.98 GiB.
- ``flat`` (``gpt1g``): PERFORMANCE.md's "GPT-like 1 GiB": the shapes of a 5-layer, d=1024,
  24k-vocabulary transformer plus Adam's two moments, seeded, as one flat dict; ciuic gets a
  module and an Adam optimizer built around those tensors (:func:`training_objects`).
- ``h200``: PERFORMANCE.md's H200 state (bf16 weights, fp32 master weights, Adam), on a GPU.
- ``lora``: a frozen 1 GiB base (64 ``Linear(2048, 2048)`` without bias) with rank-10 LoRA
  adapters on each layer (1 % of the parameters), trained by Adam: between two snapshots only
  the adapters and their moments change (``BenchState.trainable``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

Objects = tuple[torch.nn.Module, torch.optim.Optimizer]


@dataclass
class BenchState:
    """One copy of a state: ``flat`` (name -> tensor) shares every tensor with ``objects``."""

    flat: dict[str, torch.Tensor]
    objects: Objects
    #: the names of the tensors a training step changes, where not every tensor (LoRA's
    #: adapters and their moments, not the frozen base); None: all of them
    trainable: list[str] | None = None


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


def module_state(scale: int = 1, seed: int = 0, optimizer: str = "adam",
                 device: str = "cpu") -> BenchState:
    """``nn.Sequential`` of 21 ``nn.Linear(d, d)`` (d = 2048 / ``scale``) and Adam or AdamW
    after one step on a seeded batch: every parameter and both moments hold values."""
    g = torch.Generator().manual_seed(seed)
    d = 2048 // scale
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(21)]).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[optimizer]
    opt = cls(model.parameters(), lr=1e-4)
    model(torch.randn(4, d, generator=g).to(device)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        flat |= {f"optim.{i}.{k}": v for k, v in st.items() if v.dim() > 0}  # not the step
    return BenchState(flat, (model, opt))


class LoRALinear(torch.nn.Module):
    """A frozen ``Linear`` plus the trainable low-rank update ``B @ A`` (LoRA)."""

    def __init__(self, d: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(d, d, bias=False).requires_grad_(False)
        self.lora_A = torch.nn.Parameter(torch.zeros(rank, d))
        self.lora_B = torch.nn.Parameter(torch.zeros(d, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T


def lora_state(scale: int = 1, seed: int = 0, device: str = "cpu", layers: int = 64
               ) -> BenchState:
    """A frozen base of ``layers`` ``Linear(d, d)`` (d = 2048 / ``scale``: 1 GiB at scale 1)
    with rank-r adapters (r = 10 / ``scale``, at least 1: 2 x 2048 x 10 per layer at scale 1,
    1.0 % of the parameters), Adam over the adapters after one step; ``trainable``: the
    adapters and their moments."""
    g = torch.Generator().manual_seed(seed)
    d = 2048 // scale
    rank = max(1, round(10 / scale))
    model = torch.nn.Sequential(*[LoRALinear(d, rank) for _ in range(layers)]).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    adapters = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(adapters, lr=1e-4)
    model(torch.randn(4, d, generator=g).to(device)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():  # 64 layers deep, the first layers' gradients underflow: moments
        for st in opt.state.values():  # as a run's, every one nonzero (reference_state's)
            st["exp_avg"].copy_(torch.randn(st["exp_avg"].shape, generator=g) * 1e-3)
            st["exp_avg_sq"].copy_(torch.rand(st["exp_avg_sq"].shape, generator=g) * 1e-6)
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        flat |= {f"optim.{i}.{k}": v for k, v in st.items() if v.dim() > 0}
    trainable = [k for k in flat if ".lora_" in k or k.startswith("optim.")]
    return BenchState(flat, (model, opt), trainable)


def tenth_changed(flat: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager[None]:
    """Every tenth tensor (by name) changed in place (x 1.001), as an incremental snapshot's
    state; put back bit for bit after, for what is measured next."""
    return changed(flat, every=10)


@contextlib.contextmanager
def changed(flat: dict[str, torch.Tensor], every: int = 1, by: float = 1e-3,
            names: list[str] | None = None) -> Iterator[None]:
    """Every ``every``-th tensor (by name; 1: all, as after an optimizer step), or those
    ``names``, changed in place, multiplied by ``1 + by``: every nonzero element changes (an
    added constant would make Adam's tiny second moments one value, whose chunks deduplicate);
    put back bit for bit after, for what is measured next."""
    picked = [flat[k] for k in (sorted(names) if names is not None else sorted(flat)[::every])]
    kept = [t.clone() for t in picked]
    with torch.no_grad():
        for t in picked:
            t.mul_(1 + by)
    sync(flat)
    try:
        yield
    finally:
        with torch.no_grad():
            for t, k in zip(picked, kept, strict=True):
                t.copy_(k)
        sync(flat)


def build(kind: str, scale: int, device: str, optimizer: str = "adam") -> BenchState:
    """A copy of the state ``kind`` (``module``, ``flat``, ``h200``, ``lora``), seeded: two
    calls build equal values in separate memory."""
    if kind == "module":
        return module_state(scale, optimizer=optimizer, device=device)
    if kind == "lora":
        return lora_state(scale, device=device)
    flat = (h200_state(scale, device=device) if kind == "h200"
            else {k: v.to(device) for k, v in reference_state(scale).items()})
    return BenchState(flat, training_objects(flat))


def sync(state: dict[str, torch.Tensor]) -> None:
    """Wait for the device (timings on a GPU end when its work has)."""
    if any(t.is_cuda for t in state.values()):
        torch.cuda.synchronize()

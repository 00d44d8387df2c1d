"""The final state a helper job writes at its end, which tests/framework_runs.final() reads:
every model and optimizer tensor by name, and the learning rates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def write_final(model: torch.nn.Module, optimizer: Any, path: Path) -> None:
    """``optimizer``: one, or a list (each one's tensors then named by its index)."""
    tensors = {f"model/{k}": v.detach().cpu().clone().contiguous()
               for k, v in model.state_dict().items()}
    several = isinstance(optimizer, (list, tuple))
    for i, one in enumerate(optimizer if several else [optimizer]):
        name = f"optimizer{i}" if several and i else "optimizer"
        opt = one.state_dict()
        for pid, st in opt["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"{name}/{pid}/{k}"] = (v.detach().cpu().clone().contiguous()
                                                    .reshape(-1))
        tensors["lr" if name == "optimizer" else f"lr{i}"] = torch.tensor(
            [g["lr"] for g in opt["param_groups"]], dtype=torch.float64)
    save_file(tensors, str(path))


def write_final_gathered(model: torch.nn.Module, optimizer: Any, path: Path,
                         main: bool) -> None:
    """:func:`write_final` of a sharded model (FSDP2, FSDP1): the full state gathered through
    DCP on every process (a collective), written by ``main``. Optimizer tensors are named by
    parameter name (``optimizer/0.weight/exp_avg``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if not main:
        return
    tensors = {f"model/{k}": v.detach().clone().contiguous() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optimizer/{fqn}/{k}"] = v.detach().clone().contiguous().reshape(-1)
    tensors["lr"] = torch.tensor([g["lr"] for g in optimizer.param_groups], dtype=torch.float64)
    save_file(tensors, str(path))

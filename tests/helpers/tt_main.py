"""torchtitan's own ``train.main()``, as ``torchrun -m torchtitan.train`` runs it, with the shims
a CPU test machine needs applied first (tests/helpers/cpu_shims.py; docs/integrations.md lists
them):

    torchrun --nproc_per_node 2 tests/helpers/tt_main.py --module tests.helpers.tt_configs
        --config ciuic_llama3_debugmodel [torchtitan's own options ...]

``CIUIC_TT_KILL_AT=N`` SIGKILLs every rank once step N's checkpoint save returned (a due
snapshot of ciuic's is then committed: ``Trainer.train`` saves after each step). At the end
rank 0 writes ``$CIUIC_TT_OUT/final-MODE.safetensors`` (MODE: ciuic, or titan for torchtitan's
own checkpointer): every rank's model shards and optimizer
state, and the LR (:func:`dump`).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[2]))

from tests.helpers.cpu_shims import (
    import_torchtitan_without_triton,
    torch_213_for_torchtitan,
    torchtitan_on_cpu,
)

torchtitan_on_cpu()
import_torchtitan_without_triton()
torch_213_for_torchtitan()

from torchtitan import train  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402


def local(t: torch.Tensor) -> torch.Tensor:
    inner = t.to_local() if hasattr(t, "to_local") else t
    return inner.detach().clone().contiguous().reshape(-1)


def dump(trainer: Trainer, out: Path) -> None:
    """Every rank's model shards, optimizer state and LR, in one file on rank 0."""
    from safetensors.torch import save_file

    mine: dict[str, torch.Tensor] = {}
    for part in trainer.model_parts:
        for name, p in part.named_parameters():
            mine[f"model/{name}"] = local(p)
    for opt in trainer.optimizers.optimizers:
        for p, state in opt.state.items():
            name = next(n for part in trainer.model_parts for n, q in part.named_parameters()
                        if q is p)
            for k, v in state.items():
                mine[f"optimizer/{name}/{k}"] = local(v) if isinstance(v, torch.Tensor) else (
                    torch.tensor([float(v)]))
    mine["lr"] = torch.tensor([trainer.lr_schedulers.schedulers[0].get_last_lr()[0]],
                              dtype=torch.float64)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        flat = {"/".join((k.split("/", 1)[0], f"rank{r}", *k.split("/", 1)[1:])): v
                for r, d in enumerate(every) for k, v in d.items()}
        mode = "ciuic" if hasattr(trainer.checkpointer, "manager") else "titan"
        save_file(flat, str(out / f"final-{mode}.safetensors"))


def main() -> None:
    kill_at = int(os.environ.get("CIUIC_TT_KILL_AT", "0") or 0)
    out = Path(os.environ["CIUIC_TT_OUT"])
    build = Trainer.Config.build

    def built(config: Trainer.Config) -> Trainer:
        trainer = build(config)
        save = trainer.checkpointer.save

        def saved(curr_step: int, last_step: bool = False) -> None:
            save(curr_step, last_step=last_step)
            if curr_step == kill_at:
                manager = getattr(trainer.checkpointer, "manager", None)
                if manager is not None:
                    manager.wait()  # ciuic's: the due snapshot committed
                os.kill(os.getpid(), signal.SIGKILL)
            if last_step:
                dump(trainer, out)

        trainer.checkpointer.save = saved
        return trainer

    Trainer.Config.build = built
    train.main()


if __name__ == "__main__":
    main()

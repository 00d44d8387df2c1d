"""A tiny megatron-core GPT training loop for the integration tests (torchrun, CPU, gloo).

    torchrun --nproc_per_node 2 tests/helpers/mg_train.py --out DIR --mode ciuic|megatron
        [--tp N] [--pp N] [--dist-opt] [--kill-at STEP] [--every N] [--steps N]
        [--device cuda] [--no-loader-state] [--hidden N] [--model-only] [--dump-after-restore]

``GPTModel`` with the local layer spec (no fused kernels), learned absolute positions, fp32,
dropout; Megatron's DDP wrapper, its Adam (``--dist-opt``: the distributed optimizer) and an
``OptimizerParamScheduler``; a ``DistributedSampler`` over the data-parallel ranks whose samples
draw noise from torch's global RNG. ``--mode ciuic`` snapshots with MegatronSnapshots into
DIR/store every ``--every`` iterations; ``--mode megatron`` with Megatron's own
``dist_checkpointing.save`` into DIR/mg, resuming as Megatron-LM does (the iteration from the
checkpoint, the trained batches skipped). ``--kill-at`` SIGKILLs every rank at the end of that
iteration (once the last due snapshot is committed). At a normal end rank 0 writes
DIR/final-MODE.safetensors: every rank's model and optimizer tensors, as Megatron's sharded
state dict names them, and the distributed optimizer's by parameter (``main/NAME/STATE@START``,
``step/NAME``: see ``master_shards``), then prints TRAINED (iterations this run trained) and
ITERATION. ``--dump-after-restore``: the same, right after a restore, before any step, into
DIR/restored-ciuic.safetensors.

``--device cuda`` (tests/test_cuda_megatron.py): NCCL, bf16 parameters, deterministic kernels,
Megatron's real CUDA RNG tracker, no CPU shims.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from leave import leave  # beside this script

sys.path.insert(0, str(Path(__file__).parent))
import mg_cpu

SEQ, VOCAB, SAMPLES, MICRO = 8, 32, 48, 4


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed sequences whose tokens get noise from torch's global RNG at each fetch."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.base = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        seq = (self.base[i] + torch.randint(0, 2, (SEQ + 1,))) % VOCAB
        return {"tokens": seq[:-1], "labels": seq[1:]}


def build(a: argparse.Namespace) -> tuple[Any, Any, Any]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    cuda = a.device == "cuda"
    # on the CPU the tracker cannot fork a CUDA generator: the inference tracker keeps none
    model_parallel_cuda_manual_seed(123, inference_rng_tracker=not cuda)
    torch.manual_seed(123)
    dtype = torch.bfloat16 if cuda else torch.float32
    config = TransformerConfig(
        num_layers=2, hidden_size=a.hidden, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.2, attention_dropout=0.1, params_dtype=dtype, bf16=cuda,
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        pipeline_dtype=dtype)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=VOCAB, max_sequence_length=SEQ,
                   pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage(),
                   position_embedding_type="learned_absolute")
    if cuda:
        gpt.cuda()
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=a.dist_opt,
                                              bucket_size=None), gpt)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=0.01, min_lr=0.001, weight_decay=0.01,
                        use_distributed_optimizer=a.dist_opt, bf16=cuda, fp16=False,
                        clip_grad=1.0), [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=0.01, min_lr=0.001,
                                    lr_warmup_steps=2, lr_decay_steps=a.steps,
                                    lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=a.steps, wd_incr_style="constant")
    return ddp, opt, sched


def forward_step(iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(iterator)
    device = next(model.parameters()).device
    tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
    positions = torch.arange(SEQ, device=device).unsqueeze(0).expand_as(tokens)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=device), diagonal=1)
    out = model(tokens, positions, causal, labels=labels)

    def loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        value = output.float().mean()
        return value, {"loss": value.detach()}

    return out, loss


def tensors(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """This rank's model and optimizer tensors by the names of Megatron's sharded state."""
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedTensor,
        apply_factories,
    )

    sd = {"model": model.module.sharded_state_dict()}
    if opt is not None:
        sd["optimizer"] = opt.sharded_state_dict(
            sd["model"], metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    apply_factories(sd)
    out: dict[str, torch.Tensor] = {}

    def visit(x: Any) -> None:
        if isinstance(x, dict):
            pad = x.get("padding")
            if isinstance(pad, LocalNonpersistentObject) and pad.unwrap():
                return  # the distributed optimizer's padding between parameters: never set
            for v in x.values():
                visit(v)
        elif isinstance(x, list):
            for v in x:
                visit(v)
        elif isinstance(x, ShardedTensor):
            name = f"{x.key}@{','.join(map(str, x.global_offset))}"
            if x.flattened_range is not None:
                name += f"[{x.flattened_range.start}]"
            box = (1,) * x.prepend_axis_num + tuple(x.local_shape)  # (layer axis, ...)
            out[name] = x.data.detach().cpu().clone().contiguous().reshape(box)

    visit(sd)
    return out | master_shards(model, opt)


def master_shards(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """The distributed optimizer's state of this rank by parameter: ``main/NAME/STATE@START``,
    the slice of the parameter's flattened fp32 master weight (``param``) or moment that this
    rank holds, from element START; ``step/NAME`` its step count. Assembled across ranks, each
    parameter's whole state (whatever the bucket layout of the data-parallel size)."""
    out: dict[str, torch.Tensor] = {}
    names = {p: n for n, p in model.module.named_parameters()}
    for o in getattr(opt, "chained_optimizers", [opt]) if opt is not None else []:
        if type(o).__name__ != "DistributedOptimizer":
            continue
        for param, name in names.items():
            if param not in o.model_param_gbuf_map:
                continue
            gbuf, dtype, bucket = o.model_param_gbuf_map[param]
            ranges = o.gbuf_ranges[gbuf][dtype][bucket]["param_map"].get(param)
            if ranges is None:
                continue  # wholly in another rank's shard
            start = ranges["param"].start
            for k, v in o._get_main_param_and_optimizer_states(param).items():
                if k == "step":
                    out[f"step/{name}"] = v.detach().cpu().clone().reshape(())
                else:
                    out[f"main/{name}/{k}@{start}"] = v.detach().cpu().clone().reshape(-1)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["ciuic", "megatron"], default="ciuic")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dist-opt", action="store_true")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--steps", type=int, default=18)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--model-only", action="store_true")  # the optimizer is not restored
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    # after a data-parallel change a saved loader position is another sampler's: the loop
    # skips the trained batches itself, from the iteration, as Megatron-LM does
    p.add_argument("--no-loader-state", action="store_true")
    # DIR/restored-ciuic.safetensors: the state right after restore(), before any step
    p.add_argument("--dump-after-restore", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    if a.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        mg_cpu.install()
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    parallel_state.initialize_model_parallel(a.tp, a.pp)
    model, opt, sched = build(a)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    sampler = torch.utils.data.DistributedSampler(Tokens(), num_replicas=dp_size, rank=dp_rank,
                                                  shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=MICRO, sampler=sampler)
    per_epoch = len(loader)
    iteration, skip = 0, 0
    snapshots: Any = None
    if a.mode == "ciuic":
        from ciuic.integrations.megatron import MegatronSnapshots

        snapshots = MegatronSnapshots(model, None if a.model_only else opt, "tests", job="mg",
                                      scheduler=sched,
                                      store=out / "store", save_interval=a.every,
                                      loaders=[] if a.no_loader_state else [loader],
                                      handle_signals=False)
        iteration = snapshots.restore()
        # the loader resumes mid-epoch by itself, unless its position was not restored (none
        # given, or a data-parallel change): the loop skips by the iteration
        skip = 0 if snapshots.data_resumed else iteration % per_epoch
        if a.dump_after_restore and iteration:
            dump(out / "restored-ciuic.safetensors", model, None if a.model_only else opt,
                 opt.param_groups[0]["lr"], iteration)
    elif (out / "mg" / "latest").exists():
        iteration = own_load(out, model, opt, sched)
        skip = iteration % per_epoch
        if dist.get_rank() == 0:
            print(f"Resuming the Megatron loop at global step {iteration}", file=sys.stderr)
    step = get_forward_backward_func()
    trained = 0  # iterations this run trained
    while iteration < a.steps:
        epoch = iteration // per_epoch
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(skip):
            next(batches)  # the batches trained before the checkpoint
        skip = 0
        for _ in range(iteration % per_epoch, per_epoch):
            model.zero_grad_buffer()
            opt.zero_grad()
            step(forward_step_func=forward_step, data_iterator=batches, model=[model],
                 num_microbatches=1, seq_length=SEQ, micro_batch_size=MICRO)
            opt.step()
            sched.step(increment=MICRO * dp_size)
            iteration += 1
            trained += 1
            if snapshots is not None:
                snapshots.step(iteration)
            elif iteration % a.every == 0:
                own_save(out, iteration, model, opt, sched)
            if iteration == a.kill_at:
                if snapshots is not None:
                    snapshots.manager.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            if iteration >= a.steps:
                break
    if snapshots is not None:
        snapshots.finish()
        snapshots.close()
    # a distributed optimizer that never stepped cannot make its state dict (megatron-core 0.16)
    dump(out / f"final-{a.mode}.safetensors", model, None if a.model_only else opt,
         opt.param_groups[0]["lr"], iteration)
    if dist.get_rank() == 0:
        print(f"TRAINED {trained}")
        print(f"ITERATION {iteration} LR {opt.param_groups[0]['lr']:.6g}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def dump(path: Path, model: Any, opt: Any, lr: float, iteration: int) -> None:
    """Every rank's tensors (``rankR/NAME``), the learning rate and the iteration, written by
    rank 0 to ``path``."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, tensors(model, opt))
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        merged = {f"rank{r}/{k}": v for r, part in enumerate(parts) for k, v in part.items()}
        merged["lr"] = torch.tensor([lr], dtype=torch.float64)
        merged["iteration"] = torch.tensor([iteration])
        save_file(merged, str(path))


def own_state(model: Any, opt: Any, sched: Any, iteration: int) -> dict[str, Any]:
    sd: dict[str, Any] = {"model": model.module.sharded_state_dict()}
    sd["optimizer"] = opt.sharded_state_dict(
        sd["model"], metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    sd["scheduler"] = sched.state_dict()
    sd["iteration"] = iteration
    return sd


def own_save(out: Path, iteration: int, model: Any, opt: Any, sched: Any) -> None:
    from megatron.core import dist_checkpointing

    where = out / "mg" / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        where.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(own_state(model, opt, sched, iteration), str(where))
    dist.barrier()
    if dist.get_rank() == 0:
        (out / "mg" / "latest").write_text(str(iteration))


def own_load(out: Path, model: Any, opt: Any, sched: Any) -> int:
    from megatron.core import dist_checkpointing

    iteration = int((out / "mg" / "latest").read_text())
    where = out / "mg" / f"iter_{iteration:07d}"
    state = dist_checkpointing.load(own_state(model, opt, sched, iteration), str(where))
    with torch.no_grad():
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    return int(state["iteration"])


if __name__ == "__main__":
    leave(main())  # not sys.exit: see tests/helpers/leave.py

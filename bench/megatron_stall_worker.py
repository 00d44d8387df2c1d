"""One rank of bench/megatron_stall.py (run under torchrun, CPU, gloo): train a megatron-core
GPTModel at TP=2 and, interleaved in the same run, snapshot it with ciuic's MegatronSnapshots
and save it with Megatron's own asynchronous ``dist_checkpointing.save``; report the stall of
each.

The CPU shims megatron-core needs are the tests' (tests/helpers/mg_cpu.py)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
import mg_cpu  # noqa: E402  (the tests' CPU shims)


def build(a: argparse.Namespace) -> tuple[Any, Any, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    config = TransformerConfig(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=8,
        use_cpu_initialization=True, params_dtype=torch.float32, tensor_model_parallel_size=2,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=a.vocab, max_sequence_length=a.seq,
                   position_embedding_type="learned_absolute")
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), gpt)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4), [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=1e-4, max_lr=1e-4, min_lr=1e-5,
                                    lr_warmup_steps=0, lr_decay_steps=1000,
                                    lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=1000, wd_incr_style="constant")
    return ddp, opt, sched


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    mg_cpu.install()
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ciuic.integrations.megatron import MegatronSnapshots

    parallel_state.initialize_model_parallel(2, 1)
    model, opt, sched = build(a)
    snapshots = MegatronSnapshots(model, opt, "bench", job="megatron", scheduler=sched,
                                  store=Path(a.dir) / "store", save_interval=None,
                                  handle_signals=False, compression="off")
    queue = AsyncCallsQueue()
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    tokens = torch.randint(0, a.vocab, (2, a.seq))
    positions = torch.arange(a.seq).unsqueeze(0).expand_as(tokens)
    causal = torch.triu(torch.ones(1, 1, a.seq, a.seq, dtype=torch.bool), diagonal=1)

    def forward_step(_: Any, m: Any) -> tuple[torch.Tensor, Any]:
        out = m(tokens, positions, causal, labels=tokens)
        return out, lambda o: (o.float().mean(), {})

    fb = get_forward_backward_func()
    stalls: dict[str, list[float]] = {"ciuic": [], "megatron": []}
    steps: list[float] = []
    saves = 0
    for it in range(1, a.steps + 1):
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        opt.zero_grad()
        fb(forward_step_func=forward_step, data_iterator=None, model=[model],
           num_microbatches=1, seq_length=a.seq, micro_batch_size=2)
        opt.step()
        sched.step(increment=2)
        t1 = time.perf_counter()
        if it % a.every == 0:
            saves += 1
            mode = "ciuic" if saves % 2 else "megatron"
            if mode == "ciuic":
                snapshots.step(it, snapshot=True)
            else:
                where = Path(a.dir) / "mg" / f"iter_{it:07d}"
                if dist.get_rank() == 0:
                    where.mkdir(parents=True, exist_ok=True)
                dist.barrier()  # not timed: the directory exists on every rank
                t1 = time.perf_counter()
                request = dist_checkpointing.save(
                    snapshots.sharded_state_dict(is_loading=False), str(where), strategy,
                    async_sharded_save=True)
                queue.schedule_async_request(request)
            t2 = time.perf_counter()
            if saves > 2:  # the first of each: one-time set-up (buffers, the writer process)
                stalls[mode].append(t2 - t1)
        else:
            snapshots.step(it, snapshot=False)
            queue.maybe_finalize_async_calls(blocking=False)
            steps.append(t1 - t0)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    snapshots.finish()
    snapshots.close()
    mine = {"stalls": stalls, "step_median": statistics.median(steps)}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        Path(a.json).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

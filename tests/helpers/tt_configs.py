"""Configs for torchtitan's own ``train.main()`` in the tests, chosen the way its users choose
theirs (``--module tests.helpers.tt_configs --config NAME``): its ``llama3_debugmodel`` config
as torchtitan ships it, with what a CPU test machine needs changed and said here.

- the tokenizer and the dataset: torchtitan's ship in its repository's ``tests/assets``, not in
  its wheel. A byte-level BPE tokenizer (512 tokens) and a local dataset of 64 short English
  texts, both written by :func:`write_assets` (``$CIUIC_TT_ASSETS``), nothing downloaded;
- sequences of 64 tokens, a batch of 2 per rank, 12 steps; no validation (it reads another
  split), no activation checkpointing, nothing compiled; a seed (``debug.seed=0``: an
  uninterrupted run to compare with);
- torchtitan's ``ScaledDotProductAttention`` (causal) in each layer's config, in place of the
  debug model's FlexAttention, which compiles for CUDA (and masks by document);
- gloo has no ``PREMUL_SUM``, FSDP2's reduction of gradients torchtitan divides itself: each
  FSDP module sums instead (``set_force_sum_reduction_for_comms``; the factor is 1);
- ``parallelism.spmd_backend="partial_dtensor"`` (DTensor on the model-parallel axes only):
  the default, ``spmd_types``, fails in the pinned torch 2.13's ``fully_shard``;
- ``--checkpoint ciuic``: ciuic's ``CiuicCheckpointManager`` in place of torchtitan's own DCP
  ``CheckpointManager`` (``--checkpoint titan``), every 4 steps, in ``$CIUIC_TT_STORE``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:  # imported by torchtitan's ConfigManager, after tt_main's shims
    from torchtitan.trainer import Trainer

WORDS = ("the", "model", "learns", "to", "predict", "the", "next", "token", "from", "the",
         "ones", "before", "it", "while", "the", "optimizer", "moves", "every", "weight", "a",
         "little", "at", "each", "step", "and", "the", "snapshot", "keeps", "them", "all")


def write_assets(folder: Path) -> None:
    """A tokenizer (``tokenizer.json``, ``tokenizer_config.json``) and a dataset
    (``data/train.jsonl``) in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [" ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(40 + i % 9))
             for i in range(64)]
    (folder / "data").mkdir(parents=True, exist_ok=True)
    with open(folder / "data" / "train.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=512, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": special[0], "eos_token": special[1], "add_bos_token": True,
         "add_eos_token": True}))


def _sum_reductions(parallelize: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """torchtitan divides the gradients itself (``gradient_divide_factor=1.0``), which FSDP2
    reduces with ``PREMUL_SUM(1.0)``, a reduction gloo does not have: a SUM, here (the same
    numbers)."""

    def parallelized(model: nn.Module, **kwargs: Any) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule

        model = parallelize(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelized


def _cpu(config: Trainer.Config) -> Trainer.Config:
    """torchtitan's own ``config``, with what the CPU tests change (the module's list)."""
    from torchtitan.config import CompileConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    assets = os.environ["CIUIC_TT_ASSETS"]
    spec = config.model_spec
    assert spec is not None
    config.model_spec = spec = dataclasses.replace(
        spec, parallelize_fn=_sum_reductions(spec.parallelize_fn))
    for layer in spec.model.layers:  # FlexAttention (the default) compiles for CUDA
        attention = getattr(layer, "attention", None)
        if isinstance(getattr(attention, "inner_attention", None), FlexAttention.Config):
            attention.inner_attention = ScaledDotProductAttention.Config()
    config.hf_assets_path = assets
    config.dataloader = HuggingFaceTextDataLoader.Config(
        dataset="c4_test", dataset_path=str(Path(assets) / "data"))
    config.training.seq_len = 64
    config.training.local_batch_size = 2
    config.training.steps = 12
    config.validator.enable = False
    config.debug.seed = 0  # (torchtitan's default draws the weights from a fresh seed)
    config.activation_checkpoint = None
    config.compile = CompileConfig(enable=False)
    config.parallelism.pipeline_parallel_schedule = "1F1B"
    # its default, "spmd_types", hands torch 2.13's fully_shard plain parameters with the
    # mesh's dims ("all parameters must be DTensors on the full SPMD mesh")
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def _stock(name: str) -> Trainer.Config:
    """A config of torchtitan's own registries: llama3_debugmodel, deepseek_v3_debugmodel
    (an MoE: 8 experts; qwen3_moe_debug's 64 experts make 316 M parameters)."""
    if name == "llama3_debugmodel":
        from torchtitan.models.llama3.config_registry import llama3_debugmodel

        return _cpu(llama3_debugmodel())
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    return _cpu(deepseek_v3_debugmodel())


def _titan(name: str) -> Trainer.Config:
    """torchtitan's own DCP checkpointer, every 4 steps."""
    from torchtitan.components.checkpoint import CheckpointManager

    config = _stock(name)
    config.checkpoint = CheckpointManager.Config(
        enable=True, interval=4, folder=os.environ["CIUIC_TT_STORE"],
        last_save_model_only=False)
    return config


def _ciuic(name: str) -> Trainer.Config:
    """ciuic's checkpointer, every 4 steps."""
    from ciuic.integrations.torchtitan import CiuicCheckpointManager

    config = _stock(name)
    config.checkpoint = CiuicCheckpointManager.Config(
        enable=True, interval=4, project="tt", job=name, store=os.environ["CIUIC_TT_STORE"])
    return config


def titan_llama3_debugmodel() -> Trainer.Config:
    return _titan("llama3_debugmodel")


def ciuic_llama3_debugmodel() -> Trainer.Config:
    return _ciuic("llama3_debugmodel")


def titan_deepseek_v3_debugmodel() -> Trainer.Config:
    return _titan("deepseek_v3_debugmodel")


def ciuic_deepseek_v3_debugmodel() -> Trainer.Config:
    return _ciuic("deepseek_v3_debugmodel")

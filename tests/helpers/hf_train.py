"""A tiny Hugging Face Trainer job for the integration tests (run as a subprocess).

    python tests/helpers/hf_train.py --out DIR --mode ciuic|hf [--kill-at STEP] [--llama]

A GPT-2 built from a config (no download) with dropout, trained on random token sequences whose
``__getitem__`` replaces 15 % of the tokens with draws from torch's global RNG. ``--llama``: a
Llama-architecture model from a tiny ``LlamaConfig`` instead, its batches made by
``DataCollatorForLanguageModeling`` (``mlm=False``: padding, and the labels from the inputs)
with a word-level tokenizer built in memory, over sequences of varying length. ``--kill-at``
SIGKILLs the process at the end of that global step. ``--generator``: the train sampler draws
its order from its own ``torch.Generator()`` (a ``RandomSampler(generator=)`` that accelerate
does not reseed: ``use_seedable_sampler=False``). ``--mode ciuic`` trains with CiuicTrainer
into the store DIR/store; ``--mode hf`` with the plain Trainer, saving ``checkpoint-N`` folders
in DIR/hf and resuming with ``resume_from_checkpoint=True`` when one exists. At a normal end it
writes DIR/final-MODE.safetensors: every model and optimizer tensor, by name.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from finalstate import write_final  # beside this script
from torch.utils.data import Dataset, RandomSampler
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ciuic import SnapshotManager
from ciuic.integrations.transformers import with_ciuic

VOCAB, LENGTH = 64, 16


class Augmented(Dataset[dict[str, torch.Tensor]]):
    """Fixed sequences; each fetch replaces 15 % of the tokens at random (global torch RNG)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.data = torch.randint(0, VOCAB, (n, LENGTH), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i].clone()
        mask = torch.rand(LENGTH) < 0.15
        ids[mask] = torch.randint(0, VOCAB, (int(mask.sum()),))
        return {"input_ids": ids, "labels": ids.clone()}


class Varying(Augmented):
    """:class:`Augmented`, each sequence cut to a length of its own (the collator pads), as
    token ids only (the collator makes the labels)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        ids = super().__getitem__(i)["input_ids"]
        return {"input_ids": ids[:LENGTH - i % 5]}


def gpt2() -> GPT2LMHeadModel:
    """The tiny GPT-2 of these jobs, with dropout, from a config (no download)."""
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return GPT2LMHeadModel(config)


def llama() -> tuple[Any, Any]:
    """A tiny Llama (no download) and DataCollatorForLanguageModeling over a word-level
    tokenizer made in memory (the collator pads with its pad token)."""
    from tokenizers import Tokenizer, models
    from transformers import (
        DataCollatorForLanguageModeling,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    words = {str(i): i for i in range(VOCAB)} | {"[PAD]": VOCAB}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="[PAD]")),
        pad_token="[PAD]")
    config = LlamaConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=LENGTH, pad_token_id=VOCAB,
                         bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config), DataCollatorForLanguageModeling(tokenizer, mlm=False)


class KillAt(TrainerCallback):
    """SIGKILL at the end of global step ``step`` (once the snapshots started before it are
    committed, with ``manager``: so that the test knows which one the resume starts from)."""

    def __init__(self, step: int | None, manager: SnapshotManager | None = None) -> None:
        self.step = step
        self.manager = manager

    def on_step_end(self, args: object, state: object, control: object, **kw: object) -> None:
        if self.step is not None and getattr(state, "global_step", None) == self.step:
            if self.manager is not None:
                self.manager.wait()
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


class OwnGenerator(Trainer):
    """Shuffles with a generator of its own, not accelerate's seedable sampler."""

    def _get_train_sampler(self, train_dataset: Any = None) -> RandomSampler:
        dataset: Any = train_dataset if train_dataset is not None else self.train_dataset
        return RandomSampler(dataset, generator=torch.Generator())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["ciuic", "hf"], default="ciuic")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--save-strategy", default="steps")
    p.add_argument("--eval", action="store_true", help="evaluate at each epoch's end")
    p.add_argument("--generator", action="store_true")
    p.add_argument("--llama", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    # one thread: a loaded machine can make a multi-threaded kernel sum in another order (seen:
    # last-bit differences in one slow-suite run in the clean-clone CI)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt2()
    collator = None
    if a.llama:
        model, collator = llama()
    args = TrainingArguments(
        output_dir=str(out / "hf"), per_device_train_batch_size=4, num_train_epochs=a.epochs,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=3, weight_decay=0.01,
        gradient_accumulation_steps=a.accumulate, save_strategy=a.save_strategy,
        save_steps=a.save_steps, logging_steps=5, report_to=[], seed=42, use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True,
        eval_strategy="epoch" if a.eval else "no",
        accelerator_config={"use_seedable_sampler": not a.generator})
    base = OwnGenerator if a.generator else Trainer
    common = {"model": model, "args": args,
              "train_dataset": Varying(40) if a.llama else Augmented(40),
              "eval_dataset": Augmented(8) if a.eval else None, "data_collator": collator}
    if a.mode == "ciuic":
        with SnapshotManager("hf", job="tiny", store=out / "store",
                             handle_signals=False) as manager:
            trainer = with_ciuic(base)(**common, callbacks=[KillAt(a.kill_at, manager)],
                                       ciuic=manager)
            trainer.train()
            print("LATEST", manager.latest().step)  # type: ignore[union-attr]
    else:
        trainer = base(**common, callbacks=[KillAt(a.kill_at)])
        has = any(d.name.startswith("checkpoint-") for d in (out / "hf").glob("*"))
        trainer.train(resume_from_checkpoint=True if has else None)
    write_final(trainer.model, trainer.optimizer, out / f"final-{a.mode}.safetensors")
    print("GLOBAL_STEP", trainer.state.global_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())

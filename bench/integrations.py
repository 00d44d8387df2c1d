"""What snapshots cost inside Hugging Face's Trainer and Lightning: ciuic against each
framework's own checkpointing, and against a plain ``manager.step()`` loop.

    .venv/bin/python bench/integrations.py [--rounds 3] [--steps 60] [--every 20] [--json FILE]

Each configuration trains the same short job in a fresh process, the configurations interleaved
round by round:

- ``hf:none`` / ``hf:own`` / ``hf:ciuic``: a GPT-2 (d=256, 4 layers, 8k vocab: 7.3 M parameters,
  88 MB with Adam's moments) under ``transformers.Trainer``, no checkpoints / HF's own
  (``save_steps``: safetensors weights, torch.save'd optimizer, scheduler, RNG, ``trainer_state``)
  / ``CiuicTrainer``;
- ``pl:none`` / ``pl:own`` / ``pl:ciuic``: the same model as a LightningModule, no checkpoints /
  ``ModelCheckpoint(every_n_train_steps)`` / ``CiuicCallback``;
- ``loop:ciuic``: the same model and batches in a hand-written loop calling ``manager.step()``.

Reported per configuration (min / median / max over rounds): the job's training time, and the
stall per snapshot: the time between the end of a snapshot's step and the end of the next step,
minus the run's median step time (the training loop's own cost of the snapshot; the background
writing of ciuic shows in the training time instead). Snapshots every ``--every`` steps, the one
at step ``--every`` (the first: one-time costs) left out of the stall.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIGS = ["hf:none", "hf:own", "hf:ciuic", "pl:none", "pl:own", "pl:ciuic", "loop:ciuic"]


def _model_and_data(steps: int) -> tuple[Any, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=8000, n_positions=64, n_embd=256, n_layer=4, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 8000, (steps * 4, 64), generator=g)
    return GPT2LMHeadModel(config), data


class _Rows:
    def __init__(self, data: Any) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def worker(config: str, steps: int, every: int, out: Path) -> dict[str, Any]:
    """Train one configuration; return each step's end time and the saved steps."""
    import torch

    torch.set_num_threads(1)  # the other core writes ciuic's snapshots in the background
    model, data = _model_and_data(steps)
    ends: list[float] = []
    framework, kind = config.split(":")
    t0 = time.perf_counter()
    if framework == "hf":
        from transformers import Trainer, TrainerCallback, TrainingArguments

        class Clock(TrainerCallback):
            def on_step_end(self, *a: Any, **k: Any) -> None:
                ends.append(time.perf_counter())

        args = TrainingArguments(
            output_dir=str(out / "hf"), per_device_train_batch_size=4, max_steps=steps,
            save_strategy="no" if kind == "none" else "steps", save_steps=every,
            report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no",
            dataloader_num_workers=0)
        common: dict[str, Any] = {"model": model, "args": args, "train_dataset": _Rows(data),
                                  "callbacks": [Clock()]}
        if kind == "ciuic":
            from ciuic import SnapshotManager
            from ciuic.integrations.transformers import CiuicTrainer

            with SnapshotManager("bench", job="hf", store=out / "store",
                                 handle_signals=False) as m:
                CiuicTrainer(**common, ciuic=m).train()
        else:
            Trainer(**common).train()
    elif framework == "pl":
        import lightning.pytorch as pl

        class Module(pl.LightningModule):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.net = model

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                return self.net(input_ids=batch, labels=batch).loss

            def configure_optimizers(self) -> Any:
                return torch.optim.AdamW(self.parameters(), lr=5e-5)

        class Clock(pl.Callback):  # type: ignore[misc]
            def on_train_batch_end(self, *a: Any, **k: Any) -> None:
                ends.append(time.perf_counter())

        callbacks: list[Any] = [Clock()]
        if kind == "own":
            callbacks.insert(0, pl.callbacks.ModelCheckpoint(
                dirpath=str(out / "pl"), every_n_train_steps=every, save_top_k=-1))
        elif kind == "ciuic":
            from ciuic.integrations.lightning import CiuicCallback

            callbacks.insert(0, CiuicCallback("bench", job="pl", store=str(out / "store"),
                                              every_n_train_steps=every,
                                              handle_signals=False))
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                             callbacks=callbacks, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=kind == "own")
        trainer.fit(Module(), loader)
    else:
        from ciuic import SnapshotManager

        opt = torch.optim.AdamW(model.parameters(), lr=5e-5)
        with SnapshotManager("bench", job="loop", store=out / "store", save_interval=every,
                             handle_signals=False) as m:
            for step in range(1, steps + 1):
                batch = data[(step - 1) * 4:step * 4]
                model(input_ids=batch, labels=batch).loss.backward()
                opt.step()
                opt.zero_grad()
                m.step(step, model, opt)
                ends.append(time.perf_counter())
    return {"total_s": time.perf_counter() - t0, "ends": ends}


def one(config: str, steps: int, every: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
        run = subprocess.run([sys.executable, __file__, "--worker", config, "--steps",
                              str(steps), "--every", str(every), "--out", tmp],
                             capture_output=True, text=True, env=env, timeout=1200)
        if run.returncode != 0:
            raise RuntimeError(f"{config} failed:\n{run.stderr[-3000:]}")
        return json.loads(result.read_text())  # type: ignore[no-any-return]


def measure(r: dict[str, Any], every: int) -> tuple[float, list[float]]:
    """(training seconds from the first step's end, stalls of the snapshots after the first)."""
    ends = r["ends"]
    steps = [b - a for a, b in itertools.pairwise(ends)]  # steps[i]: step i+2
    median = statistics.median(steps)
    stalls = [steps[s - 1] - median for s in range(2 * every, len(ends), every)]
    return ends[-1] - ends[0], stalls


def summary(xs: list[float]) -> str:
    return f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        result = worker(a.worker, a.steps, a.every, a.out)
        (a.out / "result.json").write_text(json.dumps(result))
        return result
    configs = a.configs.split(",")
    times: dict[str, list[float]] = {c: [] for c in configs}
    stalls: dict[str, list[float]] = {c: [] for c in configs}
    for rnd in range(a.rounds):
        for c in configs if rnd % 2 == 0 else reversed(configs):
            total, stall = measure(one(c, a.steps, a.every), a.every)
            times[c].append(total)
            stalls[c].extend(stall)
            print(f"round {rnd + 1} {c:11s} training {total:.3f} s  stalls "
                  + " ".join(f"{s:.3f}" for s in stall), flush=True)
    print(f"\n{a.steps} steps, a snapshot every {a.every} (min / median / max over "
          f"{a.rounds} rounds)")
    print(f"{'config':11s}  {'training s':>23s}  {'stall per snapshot s':>23s}")
    for c in configs:
        print(f"{c:11s}  {summary(times[c]):>23s}  "
              f"{summary(stalls[c]) if stalls[c] else '-':>23s}")
    out = {"steps": a.steps, "every": a.every, "rounds": a.rounds,
           "training_s": times, "stall_s": stalls}
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()

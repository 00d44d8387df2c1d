"""torchtitan with ciuic: ``CiuicCheckpointManager``, selected by torchtitan's checkpoint config,
driving the chain from torchtitan's own components (``OptimizersContainer``,
``LRSchedulersContainer``, ``ParallelAwareDataloader``) over FSDP2, 2 ranks on CPU under
torchrun (tests/helpers/tt_train.py): SIGKILLed mid-run at a step that is not a snapshot step,
run again, every shard of the model and optimizer compared with an uninterrupted run's;
torchtitan's own DCP CheckpointManager alongside. The single-process tests check the config
and the misuses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.framework_runs import (
    differences,
    final,
    finished,
    free_port,
    launch,
    resumed_at,
    sigkilled,
)

pytest.importorskip("torchtitan", reason="pip install 'ciuic[torchtitan]'")
pytest.importorskip("safetensors.torch")

import torch
from torch import nn
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from ciuic.errors import ConfigurationError, SnapshotNotFound
from ciuic.integrations.torchtitan import CiuicCheckpointManager

HELPER = Path(__file__).parent / "helpers" / "tt_train.py"


def train(out: Path, *args: str, failpoints: str = "") -> subprocess.CompletedProcess[str]:
    return launch(HELPER, out, *args, ranks=2, failpoints=failpoints)


def killed(run: subprocess.CompletedProcess[str]) -> None:
    sigkilled(run)  # not failed for another reason
    assert "STEP 18" not in run.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run: 18 steps, snapshots every 4."""
    out = tmp_path_factory.mktemp("tt-reference")
    assert "STEP 18 SAMPLES 72" in finished(train(out)).stdout
    return out


@pytest.mark.slow
def test_fsdp2_killed_between_snapshots_ends_bit_exact(reference: Path, tmp_path: Path) -> None:
    killed(train(tmp_path, "--kill-at", "10"))  # the snapshot at step 8 is the latest
    again = finished(train(tmp_path))
    assert resumed_at(again, "torchtitan loop") == 8
    assert "STEP 18 SAMPLES 72" in again.stdout  # train_state came back
    assert differences(final(reference), final(tmp_path)) == {}


@pytest.mark.slow
def test_killed_again_inside_a_snapshot_write_it_ends_bit_exact(reference: Path,
                                                                tmp_path: Path) -> None:
    killed(train(tmp_path, "--kill-at", "10"))
    killed(second := train(tmp_path, failpoints="dist.written=kill@1"))
    assert resumed_at(second, "torchtitan loop") == 8
    again = finished(train(tmp_path))
    assert resumed_at(again, "torchtitan loop") == 8
    assert differences(final(reference), final(tmp_path)) == {}


@pytest.mark.slow
@pytest.mark.long  # the framework's own resume, not ciuic's (docs/integrations.md)
def test_torchtitan_own_resume_is_not_bit_exact_which_docs_integrations_records(
        reference: Path, tmp_path: Path) -> None:
    """The comparison in docs/integrations.md: the same kill, resumed by torchtitan's own DCP
    CheckpointManager."""
    finished(train(tmp_path / "a", "--mode", "titan"))
    killed(train(tmp_path / "b", "--mode", "titan", "--kill-at", "10"))
    again = finished(train(tmp_path / "b", "--mode", "titan"))
    assert resumed_at(again, "torchtitan loop") == 8
    # uninterrupted, the two agree: ciuic changes nothing in the training
    assert differences(final(reference), final(tmp_path / "a", "titan")) == {}
    diff = differences(final(tmp_path / "a", "titan"), final(tmp_path / "b", "titan"))
    print(f"torchtitan's own resume: {len(diff)} of {len(final(reference))} tensors differ, "
          f"max {max(diff.values()):.3g}")
    assert diff  # no RNG is saved: dropout and the augmentation differ after the resume


# -- torchtitan's own train.main() and Trainer, its llama3 debug model --------------------------

MAIN = Path(__file__).parent / "helpers" / "tt_main.py"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.tt_configs import write_assets

    folder = tmp_path_factory.mktemp("tt-assets")
    write_assets(folder)
    return folder


def titan(assets: Path, out: Path, config: str, *options: str, ranks: int = 2, kill_at: int = 0
          ) -> subprocess.CompletedProcess[str]:
    """torchtitan's ``train.main()`` under torchrun, as its users run it (``--module``,
    ``--config``, its own ``options``; the CPU shims of tests/helpers/tt_main.py), its dump
    folder in ``out``; its log (torchtitan's, ciuic's) in ``stdout``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", str(free_port()), str(MAIN), "--module",
               "tests.helpers.tt_configs", "--config", config, "--dump_folder", str(out),
               *options]
    env = {**os.environ, "CIUIC_TT_ASSETS": str(assets), "CIUIC_TT_STORE": str(out / "store"),
           "CIUIC_TT_OUT": str(out), "CIUIC_TT_KILL_AT": str(kill_at),
           "HF_DATASETS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600, env=env, cwd=Path(__file__).parents[1])


TP = ("--parallelism.tensor_parallel_degree", "2")


@pytest.mark.slow
# five torchtitan runs (the reference, ciuic's killed and resumed, torchtitan's own killed and
# resumed): past the suite's 300 s per test on a slow runner (2026-12-08: CI's and the VM's)
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("model", "ranks", "options"), [
    # llama3 with FSDP2 alone: the FSDP2+TP case covers it in CI
    pytest.param("llama3_debugmodel", 2, (), marks=pytest.mark.long),
    ("deepseek_v3_debugmodel", 2, ()),
    ("llama3_debugmodel", 4, TP)], ids=["llama3-fsdp2", "deepseek-v3-moe-fsdp2", "llama3-fsdp2-tp"])
def test_torchtitans_own_trainer_killed_ends_bit_exact_as_its_own_resume_does(
        assets: Path, tmp_path: Path, model: str, ranks: int, options: tuple[str, ...]) -> None:
    """torchtitan's own ``train.main()`` and ``Trainer`` on its own debug models, 12 steps, a
    checkpoint every 4, SIGKILLed after step 6, run again: ciuic's checkpointer and torchtitan's
    own DCP one both end with every shard equal to an uninterrupted run's (nothing in these
    loops draws random numbers), which docs/integrations.md records. ``llama3_debugmodel``
    fuses its QKV (state-dict hooks split ``wqkv``: every snapshot failed before);
    ``deepseek_v3_debugmodel`` is an MoE (8 experts, MLA attention); FSDP2 on 2 ranks, and
    FSDP2 with tensor parallelism (2 x 2) on 4."""
    reference = tmp_path / "reference"
    run = finished(titan(assets, reference, f"ciuic_{model}", *options, ranks=ranks))
    assert "step: 12" in run.stdout
    want = final(reference)
    assert {k.split("/")[1] for k in want if k.startswith("model/")} == {
        f"rank{r}" for r in range(ranks)}

    ciuic = tmp_path / "ciuic"
    stopped = titan(assets, ciuic, f"ciuic_{model}", *options, ranks=ranks, kill_at=6)
    assert stopped.returncode != 0 and "(SIGKILL)" in stopped.stdout, stopped.stdout[-3000:]
    assert not (ciuic / "final-ciuic.safetensors").exists()
    again = finished(titan(assets, ciuic, f"ciuic_{model}", *options, ranks=ranks))
    assert "Resuming training at step 5" in again.stdout, again.stdout[-3000:]
    assert differences(want, final(ciuic)) == {}

    own = tmp_path / "titan"
    stopped = titan(assets, own, f"titan_{model}", *options, ranks=ranks, kill_at=6)
    assert stopped.returncode != 0 and "(SIGKILL)" in stopped.stdout, stopped.stdout[-3000:]
    again = finished(titan(assets, own, f"titan_{model}", *options, ranks=ranks))
    assert re.search(r"Loading the checkpoint from \S+step-4", again.stdout), again.stdout[-3000:]
    diff = differences(want, final(own, "titan"))
    print(f"torchtitan's own resume of {model} on {ranks} ranks {options}: {len(diff)} of "
          f"{len(want)} tensors differ")
    assert diff == {}


# -- one process: the config, a save and load round trip, the misuses ---------------------------

class Stream(torch.utils.data.IterableDataset[torch.Tensor]):
    def __init__(self) -> None:
        self.i = 0

    def __iter__(self) -> Any:
        while True:
            self.i += 1
            yield torch.full((4,), float(self.i)) + torch.randn(4)

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = int(state["i"])


class Counter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


# not tests/models.py's: torchtitan's optimizer, scheduler and loader around a Dropout model
def parts(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 0.01})],
        implementation="for-loop").build(model_parts=[model])
    return {"model_parts": [model], "optimizers": optimizers,
            "lr_schedulers": LRSchedulersContainer.Config(warmup_steps=2).build(
                optimizers=optimizers, training_steps=10),
            "dataloader": ParallelAwareDataloader(Stream(), dp_rank=0, dp_world_size=1,
                                                  batch_size=2),
            "states": {"train_state": Counter()}, "sd_adapter": None}


def run(manager: Any, p: dict[str, Any], steps: int) -> None:
    model, optimizers = p["model_parts"][0], p["optimizers"]
    counter = p["states"]["train_state"]
    batches = iter(p["dataloader"])
    while counter.step < steps:
        counter.step += 1
        model(next(batches)).sum().backward()
        optimizers.step()
        p["lr_schedulers"].step()
        optimizers.zero_grad()
        manager.save(counter.step, last_step=counter.step == 10)


def test_the_config_selects_the_manager_and_a_rerun_resumes_exactly(tmp_path: Path) -> None:
    config = CiuicCheckpointManager.Config(enable=True, interval=3, project="t", job="j")
    assert isinstance(config, BaseCheckpointManager.Config)
    p = parts()
    manager = config.build(base_folder=str(tmp_path), **p)
    assert type(manager) is CiuicCheckpointManager
    assert manager.load() is False  # a new job
    run(manager, p, 10)
    manager.close()
    # the uninterrupted run, and a run that stopped after step 7 (the snapshot of step 6)
    whole = {k: v.clone() for k, v in p["model_parts"][0].state_dict().items()}
    stopped = tmp_path / "stopped"
    first = parts()
    m1 = config.build(base_folder=str(stopped), **first)
    run(m1, first, 7)
    m1.manager.close(final=False)  # as if it stopped there
    again = parts(seed=1)  # fresh objects, other weights: all of it must come back
    m2 = config.build(base_folder=str(stopped), **again)
    assert m2.load() is True
    assert again["states"]["train_state"].step == 6
    run(m2, again, 10)
    m2.close()
    for k, v in again["model_parts"][0].state_dict().items():
        assert torch.equal(v, whole[k]), k
    assert (tmp_path / "checkpoint").is_dir()  # the default store: the dump folder's folder


def test_a_disabled_manager_does_nothing(tmp_path: Path) -> None:
    manager = CiuicCheckpointManager.Config(enable=False).build(base_folder=str(tmp_path),
                                                                **parts())
    assert manager.load() is False and manager.save(1) is False
    manager.close()
    assert not any(tmp_path.iterdir())


def test_load_step_and_exclude_from_loading(tmp_path: Path) -> None:
    config = CiuicCheckpointManager.Config(enable=True, interval=2, job="j",
                                           exclude_from_loading=["dataloader"])
    p = parts()
    manager = config.build(base_folder=str(tmp_path), **p)
    run(manager, p, 6)
    manager.close()
    again = parts()
    m = config.build(base_folder=str(tmp_path), **again)
    assert m.load(step=4) is True
    assert again["states"]["train_state"].step == 4
    assert again["dataloader"].dataset.i == 0  # excluded: not loaded
    with pytest.raises(SnapshotNotFound, match="no snapshot at step 4000"):
        m.load(step=4000)
    m.close()


def test_misuse_is_a_clear_error(tmp_path: Path) -> None:
    p = parts()
    base = {"enable": True}
    with pytest.raises(ConfigurationError, match="pipeline parallelism"):
        CiuicCheckpointManager.Config(**base).build(
            base_folder=str(tmp_path), **{**p, "model_parts": p["model_parts"] * 2})
    with pytest.raises(ConfigurationError, match="last_save_in_hf"):
        CiuicCheckpointManager.Config(**base, last_save_in_hf=True,
                                      last_save_model_only=True).build(
            base_folder=str(tmp_path), **p)
    with pytest.raises(ConfigurationError, match="exclude_from_loading names"):
        CiuicCheckpointManager.Config(**base, exclude_from_loading=["data"]).build(
            base_folder=str(tmp_path), **p)
    with pytest.raises(ConfigurationError, match="StatefulDataLoader"):
        CiuicCheckpointManager.Config(**base).build(
            base_folder=str(tmp_path), **{**p, "dataloader": [1, 2]})
    with pytest.raises(ConfigurationError, match="states has 'model'"):
        CiuicCheckpointManager.Config(**base).build(
            base_folder=str(tmp_path), **{**p, "states": {"model": Counter()}})


def test_a_first_start_loads_the_model_of_a_torchtitan_checkpoint(tmp_path: Path) -> None:
    """initial_load_path: a model saved by torchtitan's own manager (its final, model-only
    checkpoint) seeds a new ciuic job; later starts resume from the job's snapshots."""
    from torchtitan.components.checkpointer import CheckpointManager

    seed = parts(seed=5)
    theirs = CheckpointManager.Config(enable=True, folder="dcp", interval=100,
                                      keep_latest_k=0).build(base_folder=str(tmp_path), **seed)
    run(theirs, seed, 10)  # the last step saves the model only
    theirs.close()
    trained = {k: v.clone() for k, v in seed["model_parts"][0].state_dict().items()}
    config = CiuicCheckpointManager.Config(enable=True, interval=100, job="j",
                                           initial_load_path=str(tmp_path / "dcp" / "step-10"))
    p = parts()
    ours = config.build(base_folder=str(tmp_path), **p)
    assert ours.load() is True
    for k, v in p["model_parts"][0].state_dict().items():
        assert torch.equal(v, trained[k]), k
    ours.close()
    with pytest.raises(ConfigurationError, match="initial_load_model_only=True"):
        CiuicCheckpointManager.Config(
            enable=True, job="k", initial_load_path=str(tmp_path / "dcp" / "step-10"),
            initial_load_model_only=False).build(base_folder=str(tmp_path), **parts()).load()

"""The Hugging Face Trainer integration, against the real transformers (tests/helpers/hf_train.py).

Each scenario runs the job as a subprocess, SIGKILLs it, runs the same command again, and
compares every model and optimizer tensor with the uninterrupted run's (torch.equal)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.framework_runs import differences, final, finished, resumed_at
from tests.serverutil import cli

if sys.version_info < (3, 11):
    pytest.skip("transformers 5, which CiuicTrainer needs, requires Python 3.11 or newer",
                allow_module_level=True)
transformers = pytest.importorskip("transformers", reason="pip install 'ciuic[transformers]'")
pytest.importorskip("safetensors.torch")

HELPER = Path(__file__).parent / "helpers" / "hf_train.py"


def job(out: Path, *args: str, failpoints: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CIUIC_FAILPOINTS": failpoints, "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(HELPER), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=240, env=env)




def killed(run: subprocess.CompletedProcess[str]) -> None:
    assert run.returncode == -9, (run.returncode, run.stderr[-3000:])








@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The uninterrupted job: 3 epochs of 10 steps, snapshots every 5 steps."""
    out = tmp_path_factory.mktemp("hf-reference")
    run = finished(job(out))
    assert "LATEST 30" in run.stdout  # the end of training is in the chain
    yield out


def test_killed_mid_epoch_after_epoch_0_it_ends_bit_exact(reference: Path,
                                                          tmp_path: Path) -> None:
    killed(job(tmp_path, "--kill-at", "17"))  # epoch 1, not a snapshot step
    again = finished(job(tmp_path))
    assert resumed_at(again, "Trainer") == 15  # mid-epoch: 5 batches into epoch 1
    assert not list((tmp_path / "hf").glob("checkpoint-*"))  # no HF folders: the chain only
    assert differences(final(reference), final(tmp_path)) == {}


@pytest.mark.slow
@pytest.mark.parametrize("every", [
    "5",  # resumed mid-epoch 1, from step 15
    "10",  # resumed at epoch 1's start, from step 10
], ids=["mid-epoch", "epoch-end"])
def test_a_sampler_with_its_own_generator_killed_after_epoch_0_ends_bit_exact(
        tmp_path: Path, every: str) -> None:
    """``RandomSampler(generator=torch.Generator())``: the resumed epoch's order is drawn from
    the generator as the interrupted run had it, not from a new one (epoch 0's order)."""
    args = ("--generator", "--save-steps", every)
    finished(job(tmp_path / "a", *args))
    killed(job(tmp_path / "b", *args, "--kill-at", "17"))
    again = finished(job(tmp_path / "b", *args))
    assert resumed_at(again, "Trainer") == (15 if every == "5" else 10)
    assert differences(final(tmp_path / "a"), final(tmp_path / "b")) == {}


@pytest.mark.slow
def test_killed_again_inside_a_snapshot_write_after_the_resume_it_ends_bit_exact(
        reference: Path, tmp_path: Path) -> None:
    killed(job(tmp_path, "--kill-at", "17"))
    # resumed mid-epoch from step 15, then killed while writing step 20's snapshot
    killed(second := job(tmp_path, failpoints="body.put=kill@1"))
    assert resumed_at(second, "Trainer") == 15
    third = finished(job(tmp_path))
    assert resumed_at(third, "Trainer") == 15  # step 20's snapshot never committed
    assert differences(final(reference), final(tmp_path)) == {}
    # the finished job, run again, trains nothing
    (tmp_path / "final-ciuic.safetensors").unlink()
    fourth = finished(job(tmp_path))
    assert resumed_at(fourth, "Trainer") == 30 and "GLOBAL_STEP 30" in fourth.stdout
    assert "'loss'" not in fourth.stdout  # no training step was logged
    assert differences(final(reference), final(tmp_path)) == {}


def test_a_snapshot_exports_as_a_folder_that_from_pretrained_loads(reference: Path,
                                                                    tmp_path: Path) -> None:
    run = cli(reference / "store", "restore", "hf/tiny@latest", "--to", str(tmp_path / "hf"),
              "--format", "hf")
    assert run.returncode == 0, run.stderr
    assert "from_pretrained" in run.stdout
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json",
                                                                  "model.safetensors"]
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    trained = final(reference)
    state = model.state_dict()
    assert all(torch.equal(v, trained[f"model/{k}"]) for k, v in state.items())
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    again = cli(reference / "store", "restore", "hf/tiny@latest", "--to", str(tmp_path / "hf"),
                "--format", "hf")
    assert again.returncode != 0 and "not an empty folder" in again.stderr


def test_misuse_is_a_clear_error(tmp_path: Path) -> None:
    from ciuic import ConfigurationError, SnapshotManager
    from ciuic.integrations.transformers import CiuicTrainer, with_ciuic

    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1,
                                     n_head=1, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True,
                                          report_to=[], max_steps=2)
    with pytest.raises(ConfigurationError, match="needs ciuic=SnapshotManager"):
        CiuicTrainer(model=model, args=args)
    with pytest.raises(TypeError, match=r"takes a ciuic\.SnapshotManager"):
        CiuicTrainer(model=model, args=args, ciuic="proj")
    with pytest.raises(TypeError, match=r"takes a transformers\.Trainer class"):
        with_ciuic(dict)
    assert with_ciuic(CiuicTrainer) is CiuicTrainer
    assert issubclass(CiuicTrainer, transformers.Trainer)
    ds = [{"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([1, 2, 3, 4])}] * 4
    with SnapshotManager("p", job="j", store=tmp_path / "s", handle_signals=False) as m:
        trainer = CiuicTrainer(model=model, args=args, train_dataset=ds, ciuic=m)
        trainer.train()
        with pytest.raises(ConfigurationError, match="already has snapshots"):
            trainer.train(resume_from_checkpoint=str(tmp_path / "o" / "checkpoint-2"))
        # a plain manager reads such a snapshot only with the adapter the integration registers
        info = m.latest()
        assert info is not None and info.step == 2


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "kill"), [
    (["--accumulate", "2", "--save-steps", "3"], "8"),
    (["--save-strategy", "epoch"], "23"),
    (["--eval", "--save-steps", "10"], "13"),  # an epoch's last step, evaluated after it
], ids=["gradient-accumulation", "save-per-epoch", "epoch-end-with-evaluation"])
def test_other_schedules_resume_bit_exact(tmp_path: Path, variant: list[str],
                                          kill: str) -> None:
    finished(job(tmp_path / "a", *variant))
    killed(job(tmp_path / "b", *variant, "--kill-at", kill))
    finished(job(tmp_path / "b", *variant))
    assert differences(final(tmp_path / "a"), final(tmp_path / "b")) == {}


@pytest.mark.slow
@pytest.mark.long  # the framework's own resume, not ciuic's (docs/integrations.md)
def test_hf_own_resume_is_not_bit_exact_which_docs_integrations_records(tmp_path: Path) -> None:
    """The comparison in docs/integrations.md: the same kill, resumed by HF itself."""
    finished(job(tmp_path / "a", "--mode", "hf"))
    killed(job(tmp_path / "b", "--mode", "hf", "--kill-at", "17"))
    finished(job(tmp_path / "b", "--mode", "hf"))
    diff = differences(final(tmp_path / "a", "hf"), final(tmp_path / "b", "hf"))
    print(f"HF resume: {len(diff)} tensors differ, max abs diff {max(diff.values()):.3g}")
    assert diff, "HF's own resume became bit-exact: update docs/integrations.md"


@pytest.mark.slow
def test_a_llama_with_a_collator_and_accumulation_killed_mid_epoch_ends_bit_exact(
        tmp_path: Path) -> None:
    """A Llama from a tiny LlamaConfig under Trainer, gradient accumulation 2,
    DataCollatorForLanguageModeling padding sequences of varying length; killed in epoch 1.
    HF's own resume of the same kill is measured beside it (docs/integrations.md)."""
    llama = ("--llama", "--accumulate", "2", "--save-steps", "3")
    finished(job(tmp_path / "a", *llama))
    killed(job(tmp_path / "b", *llama, "--kill-at", "8"))
    again = finished(job(tmp_path / "b", *llama))
    assert resumed_at(again, "Trainer") == 6
    reference = final(tmp_path / "a")
    assert differences(reference, final(tmp_path / "b")) == {}
    finished(job(tmp_path / "c", *llama, "--mode", "hf"))
    assert differences(reference, final(tmp_path / "c", "hf")) == {}  # ciuic changes nothing
    killed(job(tmp_path / "d", *llama, "--mode", "hf", "--kill-at", "8"))
    finished(job(tmp_path / "d", *llama, "--mode", "hf"))
    diff = differences(reference, final(tmp_path / "d", "hf"))
    print(f"HF's own resume of the Llama: {len(diff)} of {len(reference)} tensors differ"
          + (f", max {max(diff.values()):.3g}" if diff else ""))

"""DeepSpeed with ciuic, ZeRO stages 0, 1, 2 and 3 on CPU (``DS_ACCELERATOR=cpu``, gloo), 2
ranks under torchrun (tests/helpers/ds_train.py): SIGKILLed mid-epoch after epoch 0, run again,
every module tensor and every rank's optimizer partition compared with an uninterrupted run's;
DeepSpeed's own save_checkpoint/load_checkpoint alongside.

DeepSpeed compiles a small C++ op (its shared-memory communication) on first use; the tests
keep it in ``.venv/torch_extensions`` (``TORCH_EXTENSIONS_DIR``), built once per machine."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.framework_runs import final, finished, free_port, launch, resumed_at, sigkilled

pytest.importorskip("deepspeed", reason="pip install 'ciuic[deepspeed]'")
pytest.importorskip("safetensors.torch")

HELPER = Path(__file__).parent / "helpers" / "ds_train.py"
EXTENSIONS = Path(__file__).resolve().parent.parent / ".venv" / "torch_extensions"


def train(out: Path, *args: str, failpoints: str = "", ranks: int = 2
          ) -> subprocess.CompletedProcess[str]:
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(EXTENSIONS)}
    if ranks == 1:  # no torchrun: the process group from the environment, as torchrun sets it
        env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return launch(HELPER, out, *args, ranks=ranks, failpoints=failpoints, timeout=400, env=env)


def killed(run: subprocess.CompletedProcess[str]) -> None:
    sigkilled(run)  # not failed for another reason
    assert "GLOBAL_STEP" not in run.stdout


def differences(a: dict[str, object], b: dict[str, object]) -> dict[str, float]:
    import torch

    assert a.keys() == b.keys() and any(k.startswith("optimizer/rank1/") for k in a)
    ta = {k: v for k, v in a.items() if isinstance(v, torch.Tensor)}
    tb = {k: v for k, v in b.items() if isinstance(v, torch.Tensor)}
    return {k: (ta[k].double() - tb[k].double()).abs().max().item()
            for k in ta if not torch.equal(ta[k], tb[k])}


Runs = dict[tuple[str, ...], Path]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Uninterrupted runs, one per ZeRO stage (and helper arguments), made on first use: 3
    epochs of 6 steps per rank, snapshots every 4 optimizer steps."""
    return {}


def reference(references: Runs, tmp_path_factory: pytest.TempPathFactory, stage: int,
              *args: str) -> Path:
    key = (str(stage), *args)
    if key not in references:
        out = tmp_path_factory.mktemp(f"ds-reference-{stage}")
        assert "GLOBAL_STEP 18 SAMPLES 144" in finished(
            train(out, "--stage", str(stage), *args)).stdout
        references[key] = out
    return references[key]


def kill_and_resume(tmp_path: Path, stage: int, *args: str) -> Path:
    killed(train(tmp_path, "--stage", str(stage), *args, "--kill-at", "9"))  # epoch 1, 3 in
    again = finished(train(tmp_path, "--stage", str(stage), *args))
    assert resumed_at(again, "DeepSpeed loop") == 8  # and at step 9, the next: they agree
    assert "after global step 8 (epoch 1, 2 batches into it)" in again.stderr
    assert "GLOBAL_STEP 18 SAMPLES 144" in again.stdout  # the engine's counters came back
    return tmp_path


@pytest.mark.slow
def test_zero_1_killed_mid_epoch_after_epoch_0_ends_bit_exact(
        references: Runs, tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    ref = reference(references, tmp_path_factory, 1)
    assert differences(final(ref), final(kill_and_resume(tmp_path, 1))) == {}


@pytest.mark.slow
def test_a_loader_with_its_own_generator_killed_mid_epoch_after_epoch_0_ends_bit_exact(
        tmp_path: Path) -> None:
    """``DataLoader(shuffle=True, generator=torch.Generator())``: the resumed epoch's order is
    drawn from the generator as it was at the epoch's start, not from a new one."""
    finished(train(tmp_path / "a", "--generator"))
    assert differences(final(tmp_path / "a"),
                       final(kill_and_resume(tmp_path / "b", 1, "--generator"))) == {}


def test_misuse_is_a_clear_error(tmp_path: Path) -> None:
    from ciuic.integrations.deepspeed import DeepSpeedSnapshots

    with pytest.raises(TypeError, match="takes a DeepSpeed engine"):
        DeepSpeedSnapshots(object(), "p", store=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_zero_0_and_2_killed_mid_epoch_end_bit_exact(
        references: Runs, tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path, stage: int) -> None:
    ref = reference(references, tmp_path_factory, stage)
    assert differences(final(ref), final(kill_and_resume(tmp_path, stage))) == {}


@pytest.mark.slow
@pytest.mark.long  # ciuic's write path, the same in every framework: CI runs it in
# test_kill_resume and for transformers, torchtitan, megatron and Accelerate's DDP
def test_killed_again_inside_a_snapshot_write_it_ends_bit_exact(
        references: Runs, tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    ref = reference(references, tmp_path_factory, 2)
    killed(train(tmp_path, "--stage", "2", "--kill-at", "9"))
    killed(second := train(tmp_path, "--stage", "2", failpoints="body.put=kill@1"))
    assert resumed_at(second, "DeepSpeed loop") == 8
    again = finished(train(tmp_path, "--stage", "2"))
    assert resumed_at(again, "DeepSpeed loop") == 8
    assert differences(final(ref), final(tmp_path)) == {}


def own_resume(ref: Path, tmp_path: Path, stage: int, *args: str) -> dict[str, float]:
    """DeepSpeed's own resume of the kill at step 9 (``load_checkpoint``, the trained batches
    skipped by the loop): the tensors that differ from its uninterrupted run's."""
    ds = ("--stage", str(stage), *args, "--mode", "ds")
    finished(train(tmp_path / "a", *ds))
    killed(train(tmp_path / "b", *ds, "--kill-at", "9"))
    again = finished(train(tmp_path / "b", *ds))
    assert resumed_at(again, "DeepSpeed loop", own=True) == 8  # the helper's own loop says so
    # uninterrupted, the two agree: ciuic changes nothing in the training
    assert differences(final(ref), final(tmp_path / "a", "ds")) == {}
    diff = differences(final(tmp_path / "a", "ds"), final(tmp_path / "b", "ds"))
    print(f"deepspeed's own ZeRO-{stage} resume: {len(diff)} of {len(final(ref))} tensors "
          f"differ, max {max(diff.values(), default=0):.3g}")
    return diff


@pytest.mark.slow
@pytest.mark.long  # the framework's own resume, not ciuic's (docs/integrations.md)
def test_deepspeed_own_resume_is_not_bit_exact_which_docs_integrations_records(
        references: Runs, tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    """The comparison in docs/integrations.md: the same kill at ZeRO-1, resumed by DeepSpeed
    itself."""
    diff = own_resume(reference(references, tmp_path_factory, 1), tmp_path, 1)
    assert diff  # no RNG is saved: dropout and augmentation differ after the resume


@pytest.mark.slow
def test_zero_3_killed_mid_epoch_ends_bit_exact(
        references: Runs, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """ZeRO-3 (parameters partitioned), with a BatchNorm whose statistics each rank updates on
    its own: every rank's partition (fp32 and bit16, moments, step count) and buffers come
    back. Compared: the parameters gathered whole from both ranks' partitions, and each
    rank's partition and buffers."""
    want = final(reference(references, tmp_path_factory, 3, "--batchnorm"))
    assert {"optimizer/rank1/bit16/0", "optimizer/rank1/0/step",
            "optimizer/rank1/buffer/1.running_mean"} <= want.keys()
    assert want["model/0.weight"].shape == (32, 8)  # gathered: not ZeRO-3's empty placeholder
    assert not torch.equal(want["optimizer/rank0/buffer/1.running_mean"],
                           want["optimizer/rank1/buffer/1.running_mean"])  # each rank's own
    assert differences(want, final(kill_and_resume(tmp_path, 3, "--batchnorm"))) == {}


@pytest.mark.slow
def test_zero_3_restored_into_an_engine_that_has_trained_ends_bit_exact(
        references: Runs, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """``restore()`` after a training step (as a rollback in a running job): ZeRO-3 keeps its
    small ("persistent") parameters gathered after a step, and those copies must not outlive
    the restore (without releasing them first, 20 of the 26 tensors differed)."""
    want = final(reference(references, tmp_path_factory, 3, "--batchnorm"))
    killed(train(tmp_path, "--stage", "3", "--batchnorm", "--kill-at", "9"))
    again = finished(train(tmp_path, "--stage", "3", "--batchnorm", "--step-first"))
    assert resumed_at(again, "DeepSpeed loop") == 8
    assert "GLOBAL_STEP 18 SAMPLES 144" in again.stdout  # the step before it is undone too
    assert differences(want, final(tmp_path)) == {}


@pytest.mark.slow
@pytest.mark.long  # the framework's own resume, not ciuic's (docs/integrations.md)
def test_deepspeed_own_zero_3_resume_is_not_bit_exact_which_docs_integrations_records(
        references: Runs, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """The same kill at ZeRO-3, resumed by DeepSpeed itself (docs/integrations.md)."""
    ref = reference(references, tmp_path_factory, 3, "--batchnorm")
    diff = own_resume(ref, tmp_path, 3, "--batchnorm")
    assert diff  # no RNG is saved: dropout and augmentation differ after the resume
    # what its ZeRO-3 checkpoint does keep: the optimizer's step counts, the LR, the batch count
    assert not [k for k in diff if k.endswith(("/step", "num_batches_tracked")) or k == "lr"]


@pytest.mark.slow
def test_a_zero_3_snapshot_on_another_stage_or_world_size_is_refused_saying_why(
        references: Runs, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    ref = reference(references, tmp_path_factory, 3, "--batchnorm")
    for name in ("stage-2", "one-rank"):
        shutil.copytree(ref / "store", tmp_path / name / "store")
    run = train(tmp_path / "stage-2", "--stage", "2", "--batchnorm")
    assert run.returncode != 0 and "GLOBAL_STEP" not in run.stdout
    assert "StateMismatch: ranks 0, 1: the snapshot holds no model state" in run.stderr
    assert "(This engine runs ZeRO stage 2; a DeepSpeedSnapshots snapshot restores only onto " \
           "the ZeRO stage that wrote it" in run.stderr
    run = train(tmp_path / "one-rank", "--stage", "3", "--batchnorm", ranks=1)
    assert run.returncode != 0 and "GLOBAL_STEP" not in run.stdout
    assert "this ZeRO partition does not fit this engine: partition_count: snapshot 2, this " \
           "run 1; sizes: snapshot [226], this run [451]. A ZeRO snapshot restores onto the " \
           "ZeRO stage, data-parallel world size" in run.stderr

"""DeepSpeed with ciuic, ZeRO stages 0, 1 and 2 on CPU (``DS_ACCELERATOR=cpu``, gloo), 2 ranks
under torchrun (tests/helpers/ds_train.py): SIGKILLed mid-epoch after epoch 0, run again, every
module tensor and every rank's optimizer partition compared with an uninterrupted run's;
DeepSpeed's own save_checkpoint/load_checkpoint alongside.

DeepSpeed compiles a small C++ op (its shared-memory communication) on first use; the tests
keep it in ``.venv/torch_extensions`` (``TORCH_EXTENSIONS_DIR``), built once per machine."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.framework_runs import final, finished, launch, resumed_at

pytest.importorskip("deepspeed", reason="pip install 'ciuic[deepspeed]'")
pytest.importorskip("safetensors.torch")

HELPER = Path(__file__).parent / "helpers" / "ds_train.py"
EXTENSIONS = Path(__file__).resolve().parent.parent / ".venv" / "torch_extensions"


def train(out: Path, *args: str, failpoints: str = "") -> subprocess.CompletedProcess[str]:
    return launch(HELPER, out, *args, ranks=2, failpoints=failpoints, timeout=400,
                  env={"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(EXTENSIONS)})


def killed(run: subprocess.CompletedProcess[str]) -> None:
    assert run.returncode != 0, run.stdout[-2000:]
    assert "GLOBAL_STEP" not in run.stdout


def differences(a: dict[str, object], b: dict[str, object]) -> dict[str, float]:
    import torch

    assert a.keys() == b.keys() and any(k.startswith("optimizer/rank1/") for k in a)
    ta = {k: v for k, v in a.items() if isinstance(v, torch.Tensor)}
    tb = {k: v for k, v in b.items() if isinstance(v, torch.Tensor)}
    return {k: (ta[k].double() - tb[k].double()).abs().max().item()
            for k in ta if not torch.equal(ta[k], tb[k])}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Uninterrupted runs, one per ZeRO stage, made on first use: 3 epochs of 6 steps per
    rank, snapshots every 4 optimizer steps."""
    return {}


def reference(references: dict[int, Path], tmp_path_factory: pytest.TempPathFactory,
              stage: int) -> Path:
    if stage not in references:
        out = tmp_path_factory.mktemp(f"ds-reference-{stage}")
        assert "GLOBAL_STEP 18 SAMPLES 144" in finished(
            train(out, "--stage", str(stage))).stdout
        references[stage] = out
    return references[stage]


def kill_and_resume(tmp_path: Path, stage: int, *args: str) -> Path:
    killed(train(tmp_path, "--stage", str(stage), *args, "--kill-at", "9"))  # epoch 1, 3 in
    again = finished(train(tmp_path, "--stage", str(stage), *args))
    assert resumed_at(again, "DeepSpeed loop") == 8  # and at step 9, the next: they agree
    assert "after global step 8 (epoch 1, 2 batches into it)" in again.stderr
    assert "GLOBAL_STEP 18 SAMPLES 144" in again.stdout  # the engine's counters came back
    return tmp_path


@pytest.mark.slow
def test_zero_1_killed_mid_epoch_after_epoch_0_ends_bit_exact(
        references: dict[int, Path], tmp_path_factory: pytest.TempPathFactory,
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
        references: dict[int, Path], tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path, stage: int) -> None:
    ref = reference(references, tmp_path_factory, stage)
    assert differences(final(ref), final(kill_and_resume(tmp_path, stage))) == {}


@pytest.mark.slow
def test_killed_again_inside_a_snapshot_write_it_ends_bit_exact(
        references: dict[int, Path], tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    ref = reference(references, tmp_path_factory, 2)
    killed(train(tmp_path, "--stage", "2", "--kill-at", "9"))
    killed(second := train(tmp_path, "--stage", "2", failpoints="body.put=kill@1"))
    assert resumed_at(second, "DeepSpeed loop") == 8
    again = finished(train(tmp_path, "--stage", "2"))
    assert resumed_at(again, "DeepSpeed loop") == 8
    assert differences(final(ref), final(tmp_path)) == {}


@pytest.mark.slow
def test_deepspeed_own_resume_is_not_bit_exact_which_docs_integrations_records(
        references: dict[int, Path], tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    """The comparison in docs/integrations.md: the same kill at ZeRO-1, resumed by DeepSpeed
    itself (``load_checkpoint``, the trained batches skipped by the loop)."""
    ref = reference(references, tmp_path_factory, 1)
    finished(train(tmp_path / "a", "--stage", "1", "--mode", "ds"))
    killed(train(tmp_path / "b", "--stage", "1", "--mode", "ds", "--kill-at", "9"))
    again = finished(train(tmp_path / "b", "--stage", "1", "--mode", "ds"))
    assert resumed_at(again, "DeepSpeed loop", own=True) == 8  # the helper's own loop says so
    # uninterrupted, the two agree: ciuic changes nothing in the training
    assert differences(final(ref), final(tmp_path / "a", "ds")) == {}
    diff = differences(final(tmp_path / "a", "ds"), final(tmp_path / "b", "ds"))
    print(f"deepspeed's own resume: {len(diff)} of {len(final(ref))} tensors differ, max "
          f"{max(diff.values()):.3g}")
    assert diff  # no RNG is saved: dropout and augmentation differ after the resume

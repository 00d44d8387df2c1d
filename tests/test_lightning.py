"""The Lightning integration, against the real lightning and pytorch_lightning packages
(tests/helpers/pl_train.py): SIGKILL the fit, run the same command again, and compare every model
and optimizer tensor with the uninterrupted fit's (torch.equal)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.framework_runs import differences, final, finished, launch, resumed_at, sigkilled

pytest.importorskip("lightning", reason="pip install 'ciuic[lightning]'")
pytest.importorskip("safetensors.torch")

HELPER = Path(__file__).parent / "helpers" / "pl_train.py"


def fit(out: Path, *args: str, failpoints: str = "", ddp: bool = False
        ) -> subprocess.CompletedProcess[str]:
    return launch(HELPER, out, *args, *(["--ddp"] if ddp else []), ranks=2 if ddp else 1,
                  failpoints=failpoints, timeout=240)




def killed(run: subprocess.CompletedProcess[str]) -> None:
    sigkilled(run)  # not failed for another reason
    assert "GLOBAL_STEP" not in run.stdout








@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The uninterrupted fit: 3 epochs of 12 steps, snapshots every 5 steps."""
    out = tmp_path_factory.mktemp("pl-reference")
    assert "GLOBAL_STEP 36" in finished(fit(out)).stdout
    yield out


def test_killed_mid_epoch_after_epoch_0_it_ends_bit_exact(reference: Path,
                                                          tmp_path: Path) -> None:
    killed(fit(tmp_path, "--kill-at", "17"))  # epoch 1, 5 batches in: not a snapshot step
    again = finished(fit(tmp_path))
    assert resumed_at(again, "Lightning fit") == 15
    assert "not resumable" not in again.stderr  # ciuic skips the trained batches itself
    assert not list(tmp_path.rglob("*.ckpt"))  # no Lightning checkpoint files: the chain only
    assert differences(final(reference), final(tmp_path)) == {}


@pytest.mark.parametrize("every", [
    "5",  # resumed mid-epoch 1, from step 15
    pytest.param("12", marks=pytest.mark.slow),  # resumed at epoch 1's start, from step 12
], ids=["mid-epoch", "epoch-end"])
def test_a_loader_with_its_own_generator_killed_after_epoch_0_ends_bit_exact(
        tmp_path: Path, every: str) -> None:
    """``DataLoader(generator=torch.Generator())``: the resumed epoch's order is drawn from the
    generator as the interrupted run had it, not from a new one (epoch 0's order)."""
    args = ("--generator", "--every", every)
    finished(fit(tmp_path / "a", *args))
    killed(fit(tmp_path / "b", *args, "--kill-at", "17"))
    again = finished(fit(tmp_path / "b", *args))
    assert resumed_at(again, "Lightning fit") == (15 if every == "5" else 12)
    assert differences(final(tmp_path / "a"), final(tmp_path / "b")) == {}


@pytest.mark.slow
@pytest.mark.long  # ciuic's write path, the same in every framework: CI runs it in
# test_kill_resume and for transformers, torchtitan, megatron and Accelerate's DDP
def test_killed_again_inside_a_snapshot_write_after_the_resume_it_ends_bit_exact(
        reference: Path, tmp_path: Path) -> None:
    killed(fit(tmp_path, "--kill-at", "17"))
    # resumed from step 15, then killed while writing the first snapshot after the resume
    killed(second := fit(tmp_path, failpoints="body.put=kill@1"))
    assert resumed_at(second, "Lightning fit") == 15
    third = finished(fit(tmp_path))
    assert resumed_at(third, "Lightning fit") == 15  # step 20's snapshot never committed
    assert differences(final(reference), final(tmp_path)) == {}


def test_misuse_is_a_clear_error(tmp_path: Path) -> None:
    from ciuic import ConfigurationError, SnapshotManager
    from ciuic.integrations.lightning import CiuicCallback

    with pytest.raises(ConfigurationError, match="every_n_train_steps must be a positive"):
        CiuicCallback("p", job="j", every_n_train_steps=0)
    with pytest.raises(TypeError, match="a project id"):
        CiuicCallback(3)  # type: ignore[arg-type]
    with SnapshotManager("p", job="j", store=tmp_path / "s", handle_signals=False) as m:
        with pytest.raises(ConfigurationError, match="takes no job= or manager options"):
            CiuicCallback(m, job="j")
        cb = CiuicCallback(m, every_n_train_steps=3)
        assert cb.manager is m
    outside = CiuicCallback("p", job="j")
    with pytest.raises(ConfigurationError, match="outside a fit"):
        outside._manager()


@pytest.mark.slow
def test_ddp_with_two_processes_resumes_bit_exact(tmp_path: Path) -> None:
    finished(fit(tmp_path / "a", ddp=True))
    killed(fit(tmp_path / "b", "--kill-at", "11", ddp=True))  # epoch 1 (6 steps per epoch)
    again = finished(fit(tmp_path / "b", ddp=True))
    assert resumed_at(again, "Lightning fit") == 10
    assert differences(final(tmp_path / "a"), final(tmp_path / "b")) == {}


@pytest.mark.slow
def test_ddp_with_four_processes_resumes_bit_exact(tmp_path: Path) -> None:
    """Past two ranks the order in which DDP's allreduce adds the gradients depends on its
    bucket layout, which a new DDP (a resumed process) builds differently for its first step:
    CiuicCallback pins the strategy's DDP wrapper (state/ddp.py)."""
    def four(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return launch(HELPER, out, "--ddp", "--devices", "4", "--every", "2", *args, ranks=4,
                      timeout=300)
    finished(four(tmp_path / "a"))
    killed(four(tmp_path / "b", "--kill-at", "5"))  # epoch 1 (3 steps per epoch)
    again = finished(four(tmp_path / "b"))
    assert resumed_at(again, "Lightning fit") == 4
    assert differences(final(tmp_path / "a"), final(tmp_path / "b")) == {}


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    ["--every", "12", "--val"],  # a snapshot at an epoch's end, validation after it
    ["--accumulate", "2", "--every", "3"],
    ["--package", "pytorch_lightning"],
    # (OneCycleLR(total_steps=trainer.estimated_stepping_batches): the train loader is set up
    # before the callback's restore; its resumed epoch started over at batch 0, 33 of 36 steps)
    ["--schedule", "step"],
    ["--two-optimizers"],  # global_step counts both optimizers' steps: batch 17 is step 34
], ids=["epoch-end-with-validation", "gradient-accumulation", "pytorch_lightning",
        "scheduler-per-step", "two-optimizers"])
def test_other_schedules_and_the_other_package_resume_bit_exact(tmp_path: Path,
                                                                variant: list[str]) -> None:
    finished(fit(tmp_path / "a", *variant))
    kill = {"--accumulate": "9", "--two-optimizers": "34"}
    killed(fit(tmp_path / "b", *variant, "--kill-at", next(
        (step for flag, step in kill.items() if flag in variant), "17")))
    finished(fit(tmp_path / "b", *variant))
    assert differences(final(tmp_path / "a"), final(tmp_path / "b")) == {}


@pytest.mark.slow
@pytest.mark.long  # the framework's own resume, not ciuic's (docs/integrations.md)
def test_lightning_own_resume_is_not_bit_exact_which_docs_integrations_records(
        tmp_path: Path) -> None:
    """The comparison in docs/integrations.md: the same kill, resumed by Lightning itself."""
    finished(fit(tmp_path / "a", "--mode", "pl"))
    killed(fit(tmp_path / "b", "--mode", "pl", "--kill-at", "17"))
    finished(fit(tmp_path / "b", "--mode", "pl"))
    diff = differences(final(tmp_path / "a", "pl"), final(tmp_path / "b", "pl"))
    print(f"Lightning resume: {len(diff)} tensors differ, max abs diff {max(diff.values()):.3g}")
    assert diff, "Lightning's own resume became bit-exact: update docs/integrations.md"

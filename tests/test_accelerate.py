"""Hugging Face Accelerate with ciuic: a loop of your own (tests/helpers/acc_train.py), SIGKILLed
mid-epoch after epoch 0, the same command run again, and every model and optimizer tensor
compared with an uninterrupted run's; Accelerate's own save_state/load_state alongside. Under
DDP, and under Accelerate's FSDP2 (the final states gathered from the shards)."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.framework_runs import differences, final, finished, launch, resumed_at, sigkilled
from tests.helpers.noisy import Noisy

pytest.importorskip("accelerate", reason="pip install 'ciuic[accelerate]'")
pytest.importorskip("safetensors.torch")

HELPER = Path(__file__).parent / "helpers" / "acc_train.py"


def train(out: Path, *args: str, ranks: int = 2, failpoints: str = ""
          ) -> subprocess.CompletedProcess[str]:
    return launch(HELPER, out, *args, ranks=ranks, failpoints=failpoints)


def killed(run: subprocess.CompletedProcess[str]) -> None:
    sigkilled(run)  # not failed for another reason
    assert "GLOBAL_STEP" not in run.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The uninterrupted run under torchrun: 2 processes, 3 epochs of 6 steps each,
    snapshots every 4 optimizer steps."""
    out = tmp_path_factory.mktemp("acc-reference")
    assert "GLOBAL_STEP 18 SEEN 72" in finished(train(out)).stdout
    yield out


@pytest.mark.slow
def test_killed_mid_epoch_after_epoch_0_under_torchrun_it_ends_bit_exact(
        reference: Path, tmp_path: Path) -> None:
    killed(train(tmp_path, "--kill-at", "9"))  # epoch 1, 3 batches in: not a snapshot step
    again = finished(train(tmp_path))
    assert resumed_at(again, "Accelerate loop") == 8  # and at step 9, the next: they agree
    assert "after global step 8 (epoch 1, 2 batches into it)" in again.stderr
    assert "GLOBAL_STEP 18 SEEN 72" in again.stdout  # the registered object came back too
    assert differences(final(reference), final(tmp_path)) == {}


@pytest.mark.slow
def test_ddp_with_four_processes_resumes_bit_exact(tmp_path: Path) -> None:
    """Past two ranks DDP's allreduce adds in an order set by its bucket layout, which a new
    DDP builds differently for its first step (state/ddp.py). The DDP wrapper that
    ``accelerator.prepare`` returns is not among the accelerator's models (it keeps the
    unwrapped one): restore() finds it and pins it (10 tensors differed by ~1e-9 before)."""
    assert "GLOBAL_STEP 9" in finished(train(tmp_path / "a", "--every", "2", ranks=4)).stdout
    killed(train(tmp_path / "b", "--every", "2", "--kill-at", "5", ranks=4))  # epoch 1
    again = finished(train(tmp_path / "b", "--every", "2", ranks=4))
    assert resumed_at(again, "Accelerate loop") == 4
    assert differences(final(tmp_path / "a"), final(tmp_path / "b")) == {}


def test_misuse_is_a_clear_error(tmp_path: Path) -> None:
    from accelerate import Accelerator

    from ciuic.errors import ConfigurationError
    from ciuic.integrations.accelerate import AccelerateSnapshots

    with pytest.raises(TypeError, match=r"takes an accelerate\.Accelerator"):
        AccelerateSnapshots(object(), "p", store=tmp_path)
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ConfigurationError, match="after model, optimizer"):
        AccelerateSnapshots(accelerator, "p", store=tmp_path)
    # a second AccelerateSnapshots on the same loaders tracks them once, not twice
    _model, loader = accelerator.prepare(torch.nn.Linear(2, 2), torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(12, 2)), batch_size=2))
    for _ in range(2):
        snapshots = AccelerateSnapshots(accelerator, "p", store=tmp_path, handle_signals=False)
        snapshots.close()
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    assert snapshots.positions[0].consumed == 3


def fit_in_process(store: Path, own: str, stop_at: int | None = None
                   ) -> tuple[int | None, dict[str, torch.Tensor]]:
    """3 epochs of 6 steps in this process, the order drawn from a generator of the loader's
    own (``own``: given to the ``DataLoader`` or to its ``RandomSampler``), snapshots every 4
    steps. ``stop_at``: stop after that step without a snapshot of it, as a kill would; the
    next call resumes. Returns the step it resumed from and the final weights."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, RandomSampler

    from ciuic.integrations.accelerate import AccelerateSnapshots

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = Noisy(24)
    if own == "loader":
        loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator())
    else:
        sampler = RandomSampler(data, generator=torch.Generator())
        loader = DataLoader(data, batch_size=4, sampler=sampler)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    snapshots = AccelerateSnapshots(accelerator, "p", job="j", store=store, save_interval=4,
                                    handle_signals=False)
    first_epoch = snapshots.restore()
    resumed = snapshots.restored.step if snapshots.restored else None
    for _epoch in range(first_epoch, 3):
        for x, y in loader:
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            snapshots.step()
            if snapshots.global_step == stop_at:
                snapshots.manager.close(final=False)
                return resumed, {}
    snapshots.finish()
    snapshots.close()
    return resumed, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("own", ["loader", "sampler"])
def test_a_loader_with_its_own_generator_stopped_in_epoch_1_resumes_bit_exact(
        tmp_path: Path, own: str, caplog: pytest.LogCaptureFixture) -> None:
    """``DataLoader(generator=)``, or ``RandomSampler(generator=)`` (which ``prepare`` leaves
    inside the loader's batch sampler): the resumed epoch's order is drawn from the generator
    as it was at the epoch's start, not from a new one (epoch 0's order). The resume's two
    messages agree: after global step 8 (the snapshot's, done), at step 9 (the next)."""
    _, reference = fit_in_process(tmp_path / "a", own)
    fit_in_process(tmp_path / "b", own, stop_at=9)  # epoch 1, 3 batches in
    caplog.set_level(logging.INFO, logger="ciuic")
    step, resumed = fit_in_process(tmp_path / "b", own)
    assert step == 8
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert resumed_at(said, "Accelerate loop") == 8  # and at step 9: the two agree
    assert "after global step 8 (epoch 1, 2 batches into it)" in said, said
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)


@pytest.mark.slow
def test_killed_again_inside_a_snapshot_write_after_the_resume_it_ends_bit_exact(
        reference: Path, tmp_path: Path) -> None:
    killed(train(tmp_path, "--kill-at", "9"))
    # resumed from step 8, then killed while rank 0 writes the first snapshot after it
    killed(second := train(tmp_path, failpoints="body.put=kill@1"))
    assert resumed_at(second, "Accelerate loop") == 8
    again = finished(train(tmp_path))
    assert resumed_at(again, "Accelerate loop") == 8
    assert differences(final(reference), final(tmp_path)) == {}


@pytest.mark.slow
def test_gradient_accumulation_in_one_process_resumes_bit_exact(tmp_path: Path) -> None:
    args = ("--accumulate", "2", "--every", "3")
    assert "GLOBAL_STEP 18" in finished(train(tmp_path / "a", *args, ranks=1)).stdout
    killed(train(tmp_path / "b", *args, "--kill-at", "10", ranks=1))  # epoch 1
    again = finished(train(tmp_path / "b", *args, ranks=1))
    assert resumed_at(again, "Accelerate loop") == 9
    assert differences(final(tmp_path / "a"), final(tmp_path / "b")) == {}


@pytest.mark.slow
@pytest.mark.long  # the framework's own resume, not ciuic's (docs/integrations.md)
def test_accelerate_own_resume_is_not_bit_exact_which_docs_integrations_records(
        reference: Path, tmp_path: Path) -> None:
    """The comparison in docs/integrations.md: the same kill, resumed by Accelerate itself
    (``load_state`` + ``skip_first_batches``, as its examples do)."""
    own = finished(train(tmp_path / "a", "--mode", "acc"))
    assert "GLOBAL_STEP 18" in own.stdout
    killed(train(tmp_path / "b", "--mode", "acc", "--kill-at", "9"))
    finished(train(tmp_path / "b", "--mode", "acc"))
    # uninterrupted, the two agree: ciuic changes nothing in the training
    assert differences(final(reference), final(tmp_path / "a", "acc")) == {}
    diff = differences(final(tmp_path / "a", "acc"), final(tmp_path / "b", "acc"))
    print(f"accelerate's own resume: {len(diff)} of 17 tensors differ, max "
          f"{max(diff.values()):.3g}")
    assert diff  # the data order and augmentation of the resumed epoch differ


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The uninterrupted FSDP2 run (``FullyShardedDataParallelPlugin(fsdp_version=2)``): 2
    processes, 3 epochs of 6 steps each, snapshots every 4 optimizer steps."""
    out = tmp_path_factory.mktemp("acc-fsdp-reference")
    assert "GLOBAL_STEP 18 SEEN 72" in finished(train(out, "--fsdp", "2")).stdout
    yield out


def written_by_rank(store: Path) -> list[dict[str, list[int]]]:
    """For the job's latest snapshot, what each rank wrote: the first offsets of the boxes of
    each model and optimizer tensor it wrote, by path (a split body has one part per rank)."""
    from ciuic.chain.read import Parts, read_body
    from ciuic.chain.repo import Repository

    with Repository.open(store) as repo:
        m, index = read_body(repo, repo.resolve("tests/acc@latest"), parts=False)
        parts = Parts.of(repo, m, index)
        assert parts is not None, "the body is not split into one part per rank"
        return [{path: [box["offsets"][0] for box in boxes] for path, boxes in part.shards.items()}
                for part in parts.all()]


@pytest.mark.slow
def test_fsdp2_killed_mid_epoch_resumes_bit_exact_each_rank_writing_its_shards(
        fsdp_reference: Path, tmp_path: Path) -> None:
    killed(train(tmp_path, "--fsdp", "2", "--kill-at", "9"))  # epoch 1, 3 batches in
    again = finished(train(tmp_path, "--fsdp", "2"))
    assert resumed_at(again, "Accelerate loop") == 8
    assert "after global step 8 (epoch 1, 2 batches into it)" in again.stderr
    assert "GLOBAL_STEP 18 SEEN 72" in again.stdout
    # the 4 parameters and their AdamW moments, each row-sharded over the 2 ranks: each rank
    # wrote its own half (rows 0.. for rank 0, from ceil(rows / 2) for rank 1), no other's
    rows = {"model/0.weight": 32, "model/0.bias": 32, "model/3.weight": 3, "model/3.bias": 3}
    written = written_by_rank(tmp_path / "store")
    assert len(written) == 2 and len(written[0]) == 12, written
    for rank, boxes in enumerate(written):
        for path, starts in boxes.items():
            model_path = "model/" + path.split("/")[2] if path.startswith("optimizer/") else path
            assert starts == [rank * -(-rows[model_path] // 2)], (rank, path, starts)
    assert differences(final(fsdp_reference), final(tmp_path)) == {}


@pytest.mark.slow
@pytest.mark.long  # ciuic's write path, the same in every framework: CI runs it in
# test_kill_resume and for transformers, torchtitan, megatron and Accelerate's DDP
def test_fsdp2_killed_again_inside_a_snapshot_write_after_the_resume_it_ends_bit_exact(
        fsdp_reference: Path, tmp_path: Path) -> None:
    killed(train(tmp_path, "--fsdp", "2", "--kill-at", "9"))
    # resumed from step 8, then killed while a rank writes its part of the first snapshot
    killed(second := train(tmp_path, "--fsdp", "2", failpoints="body.put=kill@1"))
    assert resumed_at(second, "Accelerate loop") == 8
    again = finished(train(tmp_path, "--fsdp", "2"))
    assert resumed_at(again, "Accelerate loop") == 8
    assert differences(final(fsdp_reference), final(tmp_path)) == {}


@pytest.mark.slow
def test_fsdp2_with_gradient_accumulation_resumes_bit_exact(tmp_path: Path) -> None:
    """Accumulation 2 under FSDP2 (``accumulate`` turns gradient sync off between optimizer
    steps): 3 optimizer steps an epoch, killed in epoch 1 after step 5, resumed from step 4."""
    args = ("--fsdp", "2", "--accumulate", "2", "--every", "2")
    assert "GLOBAL_STEP 9 SEEN 72" in finished(train(tmp_path / "a", *args)).stdout
    killed(train(tmp_path / "b", *args, "--kill-at", "5"))
    again = finished(train(tmp_path / "b", *args))
    assert resumed_at(again, "Accelerate loop") == 4
    assert "after global step 4 (epoch 1, 2 batches into it)" in again.stderr
    assert differences(final(tmp_path / "a"), final(tmp_path / "b")) == {}


@pytest.mark.slow
@pytest.mark.long  # the framework's own resume, not ciuic's (docs/integrations.md)
def test_accelerate_own_fsdp2_resume_is_not_bit_exact_which_docs_integrations_records(
        fsdp_reference: Path, tmp_path: Path) -> None:
    """Accelerate's own FSDP2 checkpoint (``save_state`` with ``SHARDED_STATE_DICT``: DCP, a
    file per rank) and resume (``load_state`` + ``skip_first_batches``), the same kill."""
    own = finished(train(tmp_path / "a", "--fsdp", "2", "--mode", "acc"))
    assert "GLOBAL_STEP 18" in own.stdout
    killed(train(tmp_path / "b", "--fsdp", "2", "--mode", "acc", "--kill-at", "9"))
    assert sorted(p.name for p in (tmp_path / "b" / "acc" / "step_8" / "pytorch_model_fsdp_0"
                                   ).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    resumed = finished(train(tmp_path / "b", "--fsdp", "2", "--mode", "acc"))
    assert resumed_at(resumed, "Accelerate loop", own=True) == 8
    # uninterrupted, the two agree: ciuic changes nothing in the training
    assert differences(final(fsdp_reference), final(tmp_path / "a", "acc")) == {}
    diff = differences(final(tmp_path / "a", "acc"), final(tmp_path / "b", "acc"))
    print(f"accelerate's own FSDP2 resume: {len(diff)} of 17 tensors differ, max "
          f"{max(diff.values()):.3g}")
    # the resumed epoch's data order and augmentation differ: every parameter and moment
    assert all(k in diff for k in final(fsdp_reference) if "/" in k and not k.endswith("step"))


def test_fsdp1_is_refused_with_what_to_do_instead(tmp_path: Path) -> None:
    """FSDP1 (``fsdp_version=1``): DCP's sharded state dict of a ``FullyShardedDataParallel``
    is made of ShardedTensors, which ciuic does not write; AccelerateSnapshots says so and
    what to use, on every process, before anything is written."""
    run = train(tmp_path, "--fsdp", "1")
    assert run.returncode != 0
    assert "AccelerateSnapshots snapshots FSDP2 only, and this Accelerator runs FSDP1" in \
        run.stderr, run.stderr[-3000:]
    assert "set fsdp_version=2" in run.stderr
    assert not (tmp_path / "store").exists()  # refused before the manager opens the store

"""megatron-core with ciuic on CPU (gloo), 2 ranks under torchrun (tests/helpers/mg_train.py: a
tiny GPTModel, local layer spec, learned absolute positions, fp32, dropout, noisy data):
SIGKILLed mid-epoch, run again, every rank's model and optimizer tensors compared with an
uninterrupted run's, at TP=2, PP=2 and TP1xDP2 with the distributed optimizer; the same after
a snapshot at an epoch's end; a restore onto another layout (TP2 -> TP1xDP2); the distributed
optimizer resharded DP=2 -> DP=4 -> DP=2 (4 ranks), every global tensor compared right after
each restore with the saving run's; Megatron's own ``dist_checkpointing`` resume alongside.

The CPU shims megatron-core needs live in tests/helpers/mg_cpu.py only. Every process a run
started is SIGKILLed at its end (tests/helpers/mg_run.py): Megatron's checkpoint writer
processes outlive a killed rank, and held the output pipes open until the test timed out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.framework_runs import final, finished, resumed_at, sigkilled
from tests.helpers import mg_run

pytest.importorskip("megatron.core", reason="pip install 'ciuic[megatron]'")
pytest.importorskip("safetensors.torch")

HELPER = Path(__file__).parent / "helpers" / "mg_train.py"


def train(out: Path, *args: str, failpoints: str = "", timeout: float = 300, ranks: int = 2
          ) -> subprocess.CompletedProcess[str]:
    """One run of the helper on ``ranks`` ranks; every process it started is SIGKILLed at its
    end (tests/helpers/mg_run.py)."""
    # --standalone: torchrun binds a free port itself (a port picked here and bound later
    # could be another suite's by then)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(ranks), str(HELPER), "--out", str(out), *args]
    env = {**os.environ, "CIUIC_FAILPOINTS": failpoints, "PYTHONWARNINGS": "ignore"}
    return mg_run.run(command, env, timeout)


def differences(a: dict[str, object], b: dict[str, object]) -> dict[str, float]:
    """The tensors (``rankR/KEY@OFFSETS``: every rank's boxes) that are not equal."""
    import torch

    assert a.keys() == b.keys() and any(".exp_avg" in k for k in a)
    ta = {k: v for k, v in a.items() if isinstance(v, torch.Tensor)}
    tb = {k: v for k, v in b.items() if isinstance(v, torch.Tensor)}
    return {k: (ta[k].double() - tb[k].double()).abs().max().item()
            for k in ta if not torch.equal(ta[k], tb[k])}


def killed(run: subprocess.CompletedProcess[str]) -> None:
    sigkilled(run)  # not failed for another reason
    assert "ITERATION" not in run.stdout


def kill_and_resume(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Killed at iteration 17 (the snapshot at 15: epoch 1, 3 batches in at DP=1; epoch 2,
    3 in at DP=2), run again to 18."""
    killed(train(out, *args, "--every", "5", "--kill-at", "17"))
    again = finished(train(out, *args, "--every", "5"))
    assert resumed_at(again, "Megatron loop") == 15
    assert "ITERATION 18" in again.stdout
    return again


def reference(out: Path, *args: str) -> dict[str, object]:
    run = finished(train(out, *args, "--every", "5"))
    assert "ITERATION 18" in run.stdout
    return final(out)


@pytest.mark.timeout(600)  # three 2-rank runs: past the suite's 300 s on a loaded machine
def test_tp2_killed_mid_epoch_ends_bit_exact(tmp_path: Path) -> None:
    ref = reference(tmp_path / "a", "--tp", "2")
    kill_and_resume(tmp_path / "b", "--tp", "2")
    resumed = final(tmp_path / "b")
    assert sum(k.startswith("rank1/optimizer.") for k in resumed) > 10  # TP rank 1's too
    assert differences(ref, resumed) == {}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pp2_killed_mid_epoch_ends_bit_exact(tmp_path: Path) -> None:
    ref = reference(tmp_path / "a", "--tp", "1", "--pp", "2")
    kill_and_resume(tmp_path / "b", "--tp", "1", "--pp", "2")
    resumed = final(tmp_path / "b")
    # each stage holds its own layers: the embedding on the first, the output layer on the last
    assert any(k.startswith("rank0/embedding.") for k in resumed)
    assert any(k.startswith("rank1/output_layer.") for k in resumed)
    assert differences(ref, resumed) == {}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_distributed_optimizer_killed_mid_epoch_ends_bit_exact(tmp_path: Path) -> None:
    """TP1xDP2 with the distributed optimizer: each rank's shard of the fp32 master weights and
    moments (failed before the step counts were set right: 193 of 194 tensors differed)."""
    ref = reference(tmp_path / "a", "--tp", "1", "--dist-opt")
    kill_and_resume(tmp_path / "b", "--tp", "1", "--dist-opt")
    resumed = final(tmp_path / "b")
    assert any(k.startswith("rank1/optimizer.distributed.") for k in resumed)
    assert differences(ref, resumed) == {}


def _global(state: dict[str, object], *, gaps: bool = False) -> dict[str, object]:
    """Every global tensor, assembled from every rank's boxes (``rankR/KEY@OFFSETS``; the
    distributed optimizer's by parameter too: ``rankR/main/NAME/STATE@START``). ``gaps``: NaN
    where no box is (the padding between parameters in the distributed optimizer's buckets,
    which the helper leaves out); else every element must be covered."""
    import torch

    pieces: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    for name, t in state.items():
        if "/" in name and "@" in name and isinstance(t, torch.Tensor):
            key, offsets = name.split("/", 1)[1].rsplit("@", 1)
            pieces.setdefault(key, {})[tuple(int(o) for o in offsets.split(","))] = t
    out: dict[str, object] = {}
    for key, boxes in pieces.items():
        first = next(iter(boxes.values()))
        shape = [max(o[i] + t.shape[i] for o, t in boxes.items()) for i in range(first.dim())]
        whole = torch.full(shape, float("nan"), dtype=first.dtype)
        for o, t in boxes.items():
            whole[tuple(slice(a, a + n) for a, n in zip(o, t.shape, strict=True))] = t
        assert gaps or not whole.isnan().any(), key
        out[key] = whole
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tp2_snapshot_restores_onto_tp1_dp2(tmp_path: Path) -> None:
    """The model and the optimizer's moments, written as TP=2 halves, come back whole on each
    of two data-parallel ranks, equal to what was saved; the iteration and schedule too."""
    import torch

    saved = finished(train(tmp_path, "--tp", "2", "--steps", "8"))
    before = _global(final(tmp_path))
    (tmp_path / "final-ciuic.safetensors").unlink()
    again = finished(train(tmp_path, "--tp", "1", "--steps", "8", "--no-loader-state"))
    assert "resharded from TP2 PP1 DP1" in again.stderr
    assert saved.stdout.splitlines()[-1] == again.stdout.splitlines()[-1]  # ITERATION 8 LR x
    after = _global(final(tmp_path))
    assert before.keys() == after.keys() and any("exp_avg" in k for k in after)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    # and it trains on (the loader's position was another sampler's: the loop skips itself)
    finished(train(tmp_path, "--tp", "1", "--steps", "10", "--no-loader-state"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_again_inside_a_snapshot_write_it_ends_bit_exact(tmp_path: Path) -> None:
    ref = reference(tmp_path / "a", "--tp", "2")
    out = tmp_path / "b"
    killed(train(out, "--tp", "2", "--every", "5", "--kill-at", "17"))
    killed(second := train(out, "--tp", "2", "--every", "5", failpoints="body.put=kill@1"))
    assert resumed_at(second, "Megatron loop") == 15
    again = finished(train(out, "--tp", "2", "--every", "5"))
    assert resumed_at(again, "Megatron loop") == 15
    assert differences(ref, final(out)) == {}


@pytest.mark.slow
@pytest.mark.long  # the framework's own resume, not ciuic's (docs/integrations.md)
@pytest.mark.timeout(900)
def test_megatron_own_resume_is_not_bit_exact_which_docs_integrations_records(
        tmp_path: Path) -> None:
    """The comparison in docs/integrations.md: the same kill at TP=2, resumed by Megatron's own
    dist_checkpointing (save every 5 iterations, load, the trained batches skipped)."""
    ref = reference(tmp_path / "ref", "--tp", "2")
    finished(train(tmp_path / "a", "--tp", "2", "--every", "5", "--mode", "megatron"))
    killed(train(tmp_path / "b", "--tp", "2", "--every", "5", "--mode", "megatron",
                 "--kill-at", "17"))
    again = finished(train(tmp_path / "b", "--tp", "2", "--every", "5", "--mode", "megatron"))
    assert resumed_at(again, "Megatron loop", own=True) == 15
    # uninterrupted, the two agree: ciuic changes nothing in the training
    assert differences(ref, final(tmp_path / "a", "megatron")) == {}
    diff = differences(final(tmp_path / "a", "megatron"), final(tmp_path / "b", "megatron"))
    print(f"Megatron's own resume: {len(diff)} of {len(ref)} tensors differ, max "
          f"{max(diff.values()):.3g}")
    assert diff  # no RNG is saved: dropout and the data's noise differ after the resume


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_snapshot_of_another_model_is_refused_with_what_differs(tmp_path: Path) -> None:
    """Hidden size 16 saved, 32 asked for: every rank stops before loading anything, and the
    message names the tensors whose global shape changed."""
    finished(train(tmp_path, "--tp", "2", "--steps", "5"))
    again = train(tmp_path, "--tp", "2", "--steps", "6", "--hidden", "32")
    assert again.returncode != 0 and "ITERATION" not in again.stdout
    assert "loading the Megatron state failed on 2 ranks" in again.stderr
    assert "does not fit this model and optimizer" in again.stderr
    assert ("embedding.word_embeddings.weight: snapshot float32 [32, 16], live float32 "
            "[32, 32]") in again.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_distributed_optimizer_onto_another_tp_is_refused_and_the_model_alone_restores(
        tmp_path: Path) -> None:
    """dp_reshardable keeps the distributed optimizer's state per TPxPP bucket: TP2 -> TP1xDP2
    is refused on every rank, saying so and what to do; the model alone then restores."""
    import torch

    args = ("--dist-opt", "--no-loader-state")
    finished(train(tmp_path, "--tp", "2", "--steps", "5", *args))
    def model(out: Path) -> dict[str, object]:  # the dp_reshardable buckets have gaps
        return _global({k: v for k, v in final(out).items()
                        if "/optimizer." not in k and "/main/" not in k})

    before = model(tmp_path)
    (tmp_path / "final-ciuic.safetensors").unlink()
    refused = train(tmp_path, "--tp", "1", "--steps", "5", *args)
    assert refused.returncode != 0 and "ITERATION" not in refused.stdout
    assert "loading the Megatron state failed on 2 ranks" in refused.stderr
    assert "restores onto another data-parallel size only" in refused.stderr
    finished(train(tmp_path, "--tp", "1", "--steps", "5", "--model-only", *args))
    after = model(tmp_path)
    assert before.keys() == after.keys() and before
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def _not_equal(saved: dict[str, object], restored: dict[str, object]) -> list[str]:
    """What differs between two dumps of the helper's state, on any data-parallel size (each
    global tensor assembled from its ranks' boxes): the model's weights, each parameter's fp32
    master weight and Adam moments (``main/NAME/STATE``) and step count (``step/NAME``, on
    every rank that holds part of it), the distributed optimizer's buckets (the padding between
    parameters left out), the learning rate and the iteration. Nothing is missing from either."""
    import torch

    a, b = _global(saved, gaps=True), _global(restored, gaps=True)
    assert a.keys() == b.keys()
    counted = {n.split("/", 2)[2] for n in saved if "/step/" in n}
    for state in ("param", "exp_avg", "exp_avg_sq"):  # every parameter's, whole (below)
        assert {k[5:].rsplit("/", 1)[0] for k in a if k.endswith("/" + state)} == counted
    assert len(counted) > 20 and any(k.startswith("decoder.") for k in a)
    for k in a:
        if not k.startswith("optimizer.distributed."):
            assert not a[k].isnan().any() and not b[k].isnan().any(), k  # type: ignore[union-attr]

    def same(x: Any, y: Any) -> bool:
        gap = x.isnan()
        return torch.equal(gap, y.isnan()) and torch.equal(x[~gap], y[~gap])

    def steps(state: dict[str, object]) -> dict[str, set[float]]:
        out: dict[str, set[float]] = {}
        for name, t in state.items():
            if "/step/" in name and isinstance(t, torch.Tensor):
                out.setdefault(name.split("/", 2)[2], set()).add(float(t))
        return out

    differ = [k for k in a if not same(a[k], b[k])]
    differ += ["step counts"] * (steps(saved) != steps(restored) or not steps(saved))
    return differ + [k for k in ("lr", "iteration") if not torch.equal(
        saved[k], restored[k])]  # type: ignore[arg-type]


def _split_parameters(state: dict[str, object]) -> int:
    """The parameters whose master weight a rank holds from an element past the first: those
    the data-parallel shards cut through."""
    return len({k.split("/", 2)[2].split("/")[0] for k in state
                if re.fullmatch(r"rank\d+/main/.+/param@[1-9]\d*", k)})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_distributed_optimizer_reshards_dp2_to_dp4_and_back_exactly(tmp_path: Path) -> None:
    """TP1 PP1 with the distributed optimizer: 12 iterations on 2 ranks (DP=2), restored on 4
    (DP=4), 4 more, restored on 2 again. Right after each restore, before any step, every
    global tensor (the model, each parameter's fp32 master weight, exp_avg, exp_avg_sq and step
    assembled from the ranks' shards) equals the saving run's at its snapshot, bit for bit.
    The loaders' positions (another split's) are not used across a DP change: the loaders
    start a pass at its beginning and the loop skips by the iteration."""
    from safetensors.torch import load_file

    args = ("--tp", "1", "--dist-opt", "--every", "6")
    finished(train(tmp_path, *args, "--steps", "12"))
    saved = final(tmp_path)  # the state at the snapshot of iteration 12 (finish())
    four = finished(train(tmp_path, *args, "--steps", "16", "--dump-after-restore", ranks=4))
    assert resumed_at(four, "Megatron loop") == 12
    assert "resharded from TP1 PP1 DP2" in four.stderr and "TRAINED 4" in four.stdout
    assert "the data-parallel size changed (2 -> 4)" in four.stderr
    restored: dict[str, object] = load_file(str(tmp_path / "restored-ciuic.safetensors"))
    assert any(k.startswith("rank3/main/") for k in restored)
    # DP=4 cuts parameters that DP=2 held whole: the boxes are not the saved ones
    assert _split_parameters(restored) > _split_parameters(saved)
    assert _not_equal(saved, restored) == []

    saved = final(tmp_path)  # iteration 16, written on 4 ranks
    two = finished(train(tmp_path, *args, "--steps", "18", "--dump-after-restore"))
    assert resumed_at(two, "Megatron loop") == 16
    assert "resharded from TP1 PP1 DP4" in two.stderr and "TRAINED 2" in two.stdout
    assert "the data-parallel size changed (4 -> 2)" in two.stderr
    restored = load_file(str(tmp_path / "restored-ciuic.safetensors"))
    assert _not_equal(saved, restored) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_snapshot_at_an_epochs_end_resumes_with_the_next_epoch_bit_exact(
        tmp_path: Path) -> None:
    """TP1xDP2, the distributed optimizer, 6 batches per epoch per rank: the snapshot of
    iteration 12 is taken after epoch 1's last batch; killed at 13, resumed with the loader
    state. The loop sets epoch 2 (12 // 6) and the loader starts it from its first batch, as
    the uninterrupted run did (before 2026-12-05 it skipped that whole epoch)."""
    args = ("--tp", "1", "--dist-opt", "--every", "6")
    ref = finished(train(tmp_path / "a", *args))
    assert "TRAINED 18" in ref.stdout
    killed(train(tmp_path / "b", *args, "--kill-at", "13"))
    again = finished(train(tmp_path / "b", *args))
    assert resumed_at(again, "Megatron loop") == 12
    assert "TRAINED 6" in again.stdout and "ITERATION 18" in again.stdout
    assert differences(final(tmp_path / "a"), final(tmp_path / "b")) == {}


def test_misuse_is_a_clear_error(tmp_path: Path) -> None:
    from ciuic.errors import ConfigurationError
    from ciuic.integrations.megatron import MegatronSnapshots

    with pytest.raises(TypeError, match="megatron-core model chunks"):
        MegatronSnapshots(object(), None, "p", store=tmp_path)
    import torch

    with pytest.raises(TypeError, match="megatron-core optimizer"):
        MegatronSnapshots(_Chunk(), torch.optim.SGD([torch.zeros(1)], lr=1), "p",
                          store=tmp_path)
    with pytest.raises(ConfigurationError, match="dp_reshardable"):
        MegatronSnapshots(_Chunk(), None, "p", store=tmp_path,
                          sharding_type="fully_sharded_model_space")


class _Chunk:
    """Not a model: only what MegatronSnapshots looks for before it builds anything."""

    def sharded_state_dict(self) -> dict[str, object]:
        return {}


def test_import_ciuic_and_its_integrations_package_import_no_megatron() -> None:
    code = ("import sys, ciuic, ciuic.integrations; "
            "print(sorted(m for m in sys.modules if m.startswith('megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"

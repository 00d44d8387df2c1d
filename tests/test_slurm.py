"""The docs' Slurm script on a real Slurm cluster (tests/slurm.py: slurmctld on the host, one
slurmd per simulated node, 3 nodes; root only, skipped with the reason elsewhere).

The script is docs/multinode.md's, as written but for the sizes (2 nodes of 2 ranks, no GPUs)
and the training command (tests/helpers/sup_train.py, DDP over gloo). Each job that finishes
ends bit-identical to the same script's uninterrupted job:
- a node lost (its slurmd and the job's processes SIGKILLed): Slurm requeues the job onto the
  spare node, every rank restores from the store;
- ``scancel``: every rank takes one emergency snapshot (the SIGTERM that Slurm and torchrun
  both send a worker is one request), the job is not requeued;
- preempted twice: ``scancel --signal=USR1`` (what ``--signal=USR1@T`` sends to the step) and
  ``scancel -b --signal=USR1`` (``--signal=B:USR1@T``, to the batch shell, which passes it on):
  each time every rank takes its emergency snapshot, ``ciuic run`` requeues the job, and it
  resumes from that snapshot.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from ciuic.supervisor.slurm import hostnames
from tests.framework_runs import final
from tests.slurm import SlurmCluster, slurm_cluster
from tests.test_multinode import assert_same, committed_step, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DOCS = Path(__file__).parent.parent / "docs" / "multinode.md"
HELPER = Path(__file__).parent / "helpers" / "sup_train.py"
#: the docs' sizes and training script, and what the test runs instead
SIZES = {"--nodes=4": "--nodes=2", " --gpus-per-node=8": "", "--nproc-per-node 8":
         "--nproc-per-node 2"}
JOB = ["--steps", "60", "--every", "5", "--hidden", "128", "--step-sleep", "0.2"]


def docs_scripts() -> list[str]:
    """The ```bash blocks of docs/multinode.md's Slurm section."""
    text = DOCS.read_text()
    section = text[text.index("## Slurm\n"):text.index("## Kubernetes\n")]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def as_run(script: str, store: Path, out: Path) -> str:
    """``script`` at this test's sizes, training sup_train.py; each change made exactly once."""
    for docs, here in {**SIZES, "train.py": f"{HELPER} --store {store} "
                                            f"--out {out} {' '.join(JOB)}"}.items():
        if docs in script:
            assert script.count(docs) == 1, docs
            script = script.replace(docs, here)
    return script


def main_script(store: Path, out: Path) -> str:
    script = docs_scripts()[0]
    assert "srun ciuic run -- torchrun" in script and "--rdzv" not in script  # none by hand
    return as_run(script, store, out)


def batch_signal_script(store: Path, out: Path) -> str:
    """The main script with its step's signal replaced by the docs' ``B:`` variant."""
    main, variant = docs_scripts()[0], docs_scripts()[1]
    head = [line for line in main.splitlines()
            if line.startswith("#") and "--signal" not in line]
    return as_run("\n".join(head) + "\n" + variant, store, out)


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster(3) as c:
        yield c


@pytest.fixture(scope="module")
def reference(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted job's final state (the same script, sizes and nodes)."""
    tmp = tmp_path_factory.mktemp("slurm-ref")
    job = cluster.sbatch(main_script(tmp / "store", tmp / "out"), tmp)
    cluster.wait(job, "COMPLETED", timeout=300)
    text = (tmp / f"slurm-{job}.out").read_text(errors="replace")
    # ciuic run filled in the rendezvous from the step (node 0 hosts it)
    assert re.search(rf"Slurm job {job}, node 0 of the step: torchrun gets --nnodes 2, "
                     rf"--rdzv-backend c10d, --rdzv-endpoint c\d:29400, --rdzv-id "
                     rf"slurm-{job}, --rdzv-conf is_host=1", text), text[-3000:]
    assert "node 1 of the step" in text and "is_host=0" in text
    return tmp / "out"


def output(tmp: Path, job: int) -> str:
    return (tmp / f"slurm-{job}.out").read_text(errors="replace")


def test_a_lost_node_requeues_the_job_onto_the_spare_and_it_resumes_bit_exact(
        cluster: SlurmCluster, reference: Path, tmp_path: Path) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    job = cluster.sbatch(main_script(store, out), tmp_path, "--open-mode=append")
    first = cluster.wait(job, "RUNNING")
    wait_for(lambda: (committed_step(store) or 0) >= 10, 240, "the snapshot at step 10")
    # the job's node that is not the batch script's
    name = next(n for n in hostnames(first["NodeList"]) if n != first["BatchHost"])
    lost = cluster.names.index(name) + 1
    cluster.lose(lost)
    try:
        again = cluster.wait(job, "COMPLETED", timeout=400)
    finally:
        cluster.start_slurmd(lost)  # back for the next test, with empty memory
    text = output(tmp_path, job)
    assert again["Restarts"] == "1", again
    assert cluster.names[lost - 1] not in again["NodeList"], again  # on the spare
    resumed = re.findall(r"Resuming training at step (\d+)", text)
    assert resumed and int(resumed[-1]) >= 11, text[-4000:]
    assert_same(final(out), final(reference))
    cluster.wait_nodes()


def test_preemption_by_sigusr1_snapshots_every_rank_requeues_and_resumes_bit_exact(
        cluster: SlurmCluster, reference: Path, tmp_path: Path) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    job = cluster.sbatch(batch_signal_script(store, out), tmp_path, "--open-mode=append")
    cluster.wait(job, "RUNNING")
    emergency: list[int] = []
    for sent, how in enumerate((["--signal=USR1"], ["-b", "--signal=USR1"]), 1):
        past = max(emergency, default=0) + 3
        wait_for(lambda past=past: (committed_step(store) or 0) >= past, 240,  # type: ignore[misc]
                 f"a snapshot past step {past}")
        cluster.command("scancel", *how, str(job))
        wait_for(lambda sent=sent: int(cluster.job(job)["Restarts"]) >= sent,  # type: ignore[misc]
                 240,
                 f"the requeue after preemption {sent}")
        text = output(tmp_path, job)
        steps = [int(s) for s in re.findall(r"Emergency snapshot at step (\d+) saved", text)]
        assert steps and steps[-1] > max(emergency, default=0), text[-4000:]
        emergency.append(steps[-1])
        assert f"Slurm job {job} requeued (scontrol requeue {job})" in text, text[-4000:]
        assert committed_step(store) == emergency[-1]
        cluster.wait(job, "RUNNING")
    done = cluster.wait(job, "COMPLETED", timeout=400)
    assert done["Restarts"] == "2", done
    text = output(tmp_path, job)
    resumed = [int(s) for s in re.findall(r"Resuming training at step (\d+)", text)]
    assert resumed == [e + 1 for e in emergency], (resumed, emergency, text[-4000:])
    assert_same(final(out), final(reference))


def test_scancel_gives_one_emergency_snapshot_on_every_rank_and_no_requeue(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    """``scancel`` sends SIGTERM to every process of the step: a worker gets it from Slurm and
    again from torchrun (and torchrun from Slurm and from ciuic run) within milliseconds; each
    rank still takes one emergency snapshot, the same step on all, and the job is not
    requeued (a cancel is not a preemption notice)."""
    store, out = tmp_path / "store", tmp_path / "out"
    job = cluster.sbatch(main_script(store, out), tmp_path)
    cluster.wait(job, "RUNNING")
    wait_for(lambda: (committed_step(store) or 0) >= 5, 240, "the snapshot at step 5")
    cluster.command("scancel", str(job))
    cluster.wait(job, "CANCELLED", timeout=120)  # at once: its processes still run
    saved_at = re.compile(r"\[WARNING(?: rank \d)?\] Emergency snapshot at step (\d+) saved")
    # (KillWait, 10 s here, before Slurm's SIGKILL)
    wait_for(lambda: len(saved_at.findall(output(tmp_path, job))) >= 4, 60,
             "every rank's emergency snapshot")
    text = output(tmp_path, job)
    saved = saved_at.findall(text)
    assert len(saved) == 4 and len(set(saved)) == 1, text[-4000:]  # every rank, one step
    assert committed_step(store) == int(saved[0])
    assert "again: killing the job" not in text and "requeued" not in text, text[-4000:]
    assert cluster.job(job)["Restarts"] == "0"

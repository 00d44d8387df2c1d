"""``ciuic run`` under a Slurm job step, without Slurm: the host lists, the rendezvous read from
the step's environment (what the user gave is kept), and the requeue's errors. The real
cluster's tests are in tests/test_slurm.py."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from ciuic.cli.run import elastic_note, with_keep_alive, with_slurm
from ciuic.errors import ConfigurationError
from ciuic.supervisor import slurm

STEP = {"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[07-08,11]",
        "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_PROCID": "2"}


@pytest.mark.parametrize("nodelist, hosts", [
    ("c1", ["c1"]),
    ("c[1-3,7]", ["c1", "c2", "c3", "c7"]),
    ("gpu[07-08,11],login", ["gpu07", "gpu08", "gpu11", "login"]),
    ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
    ("a-b[009-011].ib", ["a-b009.ib", "a-b010.ib", "a-b011.ib"]),
])
def test_host_lists_expand_as_scontrol_show_hostnames(nodelist: str, hosts: list[str]) -> None:
    assert slurm.hostnames(nodelist) == hosts


def test_a_host_list_that_cannot_be_read_says_which_range() -> None:
    with pytest.raises(ConfigurationError, match=r"the range 'x-2'"):
        slurm.hostnames("c[x-2]")


def test_a_step_gives_torchrun_its_rendezvous_and_node_0_hosts_it() -> None:
    command, said = with_slurm(["torchrun", "--nproc-per-node", "8", "--max-restarts", "100",
                                "train.py", "--lr", "1e-3"], STEP)
    assert command == ["torchrun", "--rdzv-conf", "is_host=0", "--nnodes", "3",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu07:29400",
                       "--rdzv-id", "slurm-812", "--nproc-per-node", "8", "--max-restarts",
                       "100", "train.py", "--lr", "1e-3"]
    assert said == ("Slurm job 812, node 2 of the step: torchrun gets --nnodes 3, "
                    "--rdzv-backend c10d, --rdzv-endpoint gpu07:29400, --rdzv-id slurm-812, "
                    "--rdzv-conf is_host=0")
    host, _ = with_slurm(["torchrun", "train.py"], {**STEP, "SLURM_NODEID": "0"})
    assert host[1:3] == ["--rdzv-conf", "is_host=1"]
    # then the keep-alive joins the same --rdzv-conf (torchrun takes only the last one)
    kept, _ = with_keep_alive(command)
    assert kept.count("--rdzv-conf") == 1
    assert "is_host=0,keep_alive_interval=2,keep_alive_max_attempt=3" in kept


def test_what_the_user_gave_is_kept() -> None:
    given = ["python", "-m", "torch.distributed.run", "--nnodes=3", "--rdzv-backend=c10d",
             "--rdzv_endpoint", "head:1234", "--rdzv-conf", "timeout=900", "--rdzv-id",
             "mine", "train.py"]
    command, said = with_slurm(given, STEP)
    assert command == ["python", "-m", "torch.distributed.run", "--nnodes=3",
                       "--rdzv-backend=c10d", "--rdzv_endpoint", "head:1234", "--rdzv-conf",
                       "timeout=900,is_host=0", "--rdzv-id", "mine", "train.py"]
    assert said is not None and said.endswith("torchrun gets --rdzv-conf is_host=0")
    # a rendezvous of its own (is_host said too), --standalone, one node: nothing to add
    full = [*given[:8], "timeout=900,is_host=1", *given[9:]]
    assert with_slurm(full, STEP) == (full, None)
    assert with_slurm(["torchrun", "--standalone", "t.py"], STEP) == (
        ["torchrun", "--standalone", "t.py"], None)
    static = ["torchrun", "--rdzv-endpoint", "head:1234", "t.py"]  # torchrun's static default
    assert with_slurm(static, STEP)[0] == ["torchrun", "--nnodes", "3", "--rdzv-id",
                                           "slurm-812", *static[1:]]
    one = {**STEP, "SLURM_STEP_NODELIST": "gpu07", "SLURM_STEP_TASKS_PER_NODE": "1"}
    assert with_slurm(["torchrun", "t.py"], one) == (
        ["torchrun", "--nnodes", "1", "t.py"], "Slurm job 812, node 2 of the step: torchrun "
        "gets --nnodes 1")


def test_outside_a_job_step_and_for_other_commands_nothing_changes() -> None:
    batch = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}  # the batch script
    assert with_slurm(["torchrun", "t.py"], batch) == (["torchrun", "t.py"], None)
    assert with_slurm(["python", "t.py"], STEP) == (["python", "t.py"], None)


def test_several_tasks_per_node_are_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigurationError, match=r"srun --ntasks-per-node=1"):
        with_slurm(["torchrun", "t.py"], {**STEP, "SLURM_STEP_TASKS_PER_NODE": "8(x3)"})


def test_the_requeue_is_asked_by_task_0_and_its_failure_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert slurm.requeue({**STEP}) == (False, "")  # task 2: task 0 asks
    assert slurm.requeue({}) == (False, "")  # not under Slurm
    task0 = {**STEP, "SLURM_PROCID": "0"}
    monkeypatch.setenv("PATH", str(tmp_path))
    ok, said = slurm.requeue(task0)
    assert not ok and "scontrol is not on this node's PATH" in said
    # a scontrol that refuses, as Slurm does for a job without --requeue
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho 'scontrol: error: Requested operation is presently "
                    "disabled for job 812' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    ok, said = slurm.requeue(task0)
    assert not ok and "presently disabled" in said and "sbatch --requeue" in said


def test_an_elastic_torchrun_is_told_what_a_lost_node_with_no_replacement_costs() -> None:
    """--nnodes MIN:MAX: ciuic run says the others go on without a lost node, and after how
    long (the last call the user set, or torch's default and how to set it)."""
    base = ["torchrun", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400"]
    said = elastic_note([*base, "--nnodes", "2:10", "train.py"])
    assert said is not None and said.startswith("the job runs on 2 to 10 nodes")
    assert "torch's 30 s; --rdzv-conf last_call_timeout=SECONDS" in said
    given = elastic_note([*base, "--nnodes=9:10", "--rdzv-conf", "is_host=1,last_call_timeout=5",
                          "train.py"])
    assert given is not None and "its last call (5 s, --rdzv-conf last_call_timeout)" in given
    for fixed in ("3", "3:3", "10:9"):  # as many nodes as asked, or an odd range: nothing
        assert elastic_note([*base, "--nnodes", fixed, "train.py"]) is None
    assert elastic_note(["torchrun", "--nnodes", "2:3", "--standalone", "train.py"]) is None


def test_a_step_gives_ciuic_runs_own_ranks_their_nodes_and_node_0_leads() -> None:
    nnodes, node_rank, master, said = slurm.node_args(STEP, None, None, None)
    assert (nnodes, node_rank, master) == (3, 2, "gpu07")
    assert said == "from the Slurm step 812.0: --nnodes 3 --node-rank 2 --master-addr gpu07"
    # what was given is kept: two nodes of ranks, the third a spare node
    nnodes, node_rank, master, said = slurm.node_args(STEP, 2, None, "10.0.0.1")
    assert (nnodes, node_rank, master) == (2, 2, "10.0.0.1")
    assert said == "from the Slurm step 812.0: --node-rank 2"
    alone = {**STEP, "SLURM_STEP_NODELIST": "gpu07", "SLURM_NODEID": "0"}
    assert slurm.node_args(alone, None, None, None)[:3] == (1, 0, None)  # one node: none
    assert slurm.node_args({}, None, None, None) == (1, None, None, None)  # outside a step
    with pytest.raises(ConfigurationError, match=r"srun --ntasks-per-node=1 \(ciuic run starts"):
        slurm.node_args({**STEP, "SLURM_STEP_TASKS_PER_NODE": "8(x3)"}, None, None, None)

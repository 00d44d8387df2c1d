"""``ciuic run`` inside a Slurm job step (docs/multinode.md, "Slurm"): the rendezvous read from
the job's environment, and the requeue after a preemption notice.

- :func:`torchrun_args`: under ``srun``, a torchrun that does not say them gets ``--nnodes``
  (the step's nodes), ``--rdzv-backend c10d``, ``--rdzv-endpoint FIRST_NODE:29400`` (the first
  host of ``SLURM_STEP_NODELIST``), ``--rdzv-id`` (the job's id) and ``is_host`` in
  ``--rdzv-conf`` (whether this is the step's node 0, ``SLURM_NODEID``): the batch script needs
  no rendezvous lines. What the user gave is never changed.
- :func:`node_args`: the same for ``ciuic run --nproc-per-node`` (in-process recovery on
  several nodes): ``--nnodes``, ``--node-rank``, ``--master-addr``.
- :func:`requeue`: after SIGUSR1 (Slurm's usual warning, ``--signal=USR1@T`` or ``scancel
  --signal=USR1``) the job took its emergency snapshot and exited; the step's first task asks
  Slurm to requeue the job (``scontrol requeue``), which then resumes from that snapshot.

Imports no torch.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping

from ciuic.errors import ConfigurationError

#: the rendezvous port on the step's first node, as torchrun's docs and examples use
RDZV_PORT = 29400
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def hostnames(nodelist: str) -> list[str]:
    """The hosts of a Slurm host list, in order (``c[1-3,7],gpu-a[01-02]`` -> c1, c2, c3, c7,
    gpu-a01, gpu-a02; zero padding kept), as ``scontrol show hostnames`` prints them."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        parts = re.split(r"(\[[^\]]*\])", item)
        names = [""]
        for part in parts:
            if part.startswith("["):
                expanded = []
                for piece in part[1:-1].split(","):
                    m = _RANGE.match(piece)
                    if not m:
                        raise ConfigurationError(f"cannot read the Slurm host list {nodelist!r}"
                                                 f" (the range {piece!r})")
                    lo, hi = m.group(1), m.group(2) or m.group(1)
                    expanded += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
                names = [n + e for n in names for e in expanded]
            else:
                names = [n + part for n in names]
        hosts += names
    return hosts


def in_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a task of a Slurm job step (``srun``), not a batch script."""
    return "SLURM_JOB_ID" in environ and "SLURM_STEP_ID" in environ


def _one_task_per_node(environ: Mapping[str, str], starts: str) -> None:
    tasks = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "1")
    if tasks.split("(")[0] not in ("1", ""):
        raise ConfigurationError(
            f"ciuic run runs once per node under Slurm, and this step runs {tasks} tasks per "
            f"node: start it with srun --ntasks-per-node=1 ({starts} the ranks of the node, "
            "--nproc-per-node)")


def _step_hosts(environ: Mapping[str, str]) -> list[str]:
    return hostnames(environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                     or "")


def node_args(environ: Mapping[str, str], nnodes: int | None, node_rank: int | None,
              master_addr: str | None) -> tuple[int, int | None, str | None, str | None]:
    """``ciuic run --nproc-per-node``'s nodes under a Slurm step, where not given: ``--nnodes``
    the step's nodes, ``--node-rank`` this node's (``SLURM_NODEID``), ``--master-addr`` the
    step's first host. (Started on more nodes than ``--nnodes``, the nodes past it are spare
    nodes.) Returns them and a line saying what was taken from the step (None: nothing);
    outside a step, what was given (``--nnodes`` 1 where not)."""
    if not in_step(environ):
        return nnodes or 1, node_rank, master_addr, None
    _one_task_per_node(environ, "ciuic run starts")
    nodes = _step_hosts(environ)
    took = []
    if nnodes is None and nodes:
        nnodes = len(nodes)
        took.append(f"--nnodes {nnodes}")
    if node_rank is None and environ.get("SLURM_NODEID", "").isdigit():
        node_rank = int(environ["SLURM_NODEID"])
        took.append(f"--node-rank {node_rank}")
    if master_addr is None and nodes and (nnodes or 1) > 1:
        master_addr = nodes[0]
        took.append(f"--master-addr {master_addr}")
    said = f"from the Slurm step {environ['SLURM_JOB_ID']}.{environ['SLURM_STEP_ID']}: " \
        f"{' '.join(took)}" if took else None
    return nnodes or 1, node_rank, master_addr, said


def torchrun_args(environ: Mapping[str, str], given: Mapping[str, str | None]
                  ) -> tuple[list[str], dict[str, str]]:
    """What a Slurm step adds to torchrun's own arguments (see the module's docstring): the
    options, and the ``--rdzv-conf`` keys; ``given`` maps each option to the value the user
    gave (None: not given). Nothing outside a job step."""
    if not in_step(environ):
        return [], {}
    _one_task_per_node(environ, "torchrun starts")
    nodes = _step_hosts(environ)
    added: list[str] = []
    conf: dict[str, str] = {}
    if given.get("--nnodes") is None and nodes:
        added += ["--nnodes", str(len(nodes))]
    several = len(nodes) > 1 or (given.get("--nnodes") or "1") not in ("1", "1:1")
    if several:
        backend = given.get("--rdzv-backend")
        if backend is None and given.get("--rdzv-endpoint") is None:
            added += ["--rdzv-backend", "c10d"]
            backend = "c10d"
        if given.get("--rdzv-endpoint") is None and nodes:
            added += ["--rdzv-endpoint", f"{nodes[0]}:{RDZV_PORT}"]
        if given.get("--rdzv-id") is None:
            added += ["--rdzv-id", f"slurm-{environ['SLURM_JOB_ID']}"]
        if (backend == "c10d" and "is_host=" not in (given.get("--rdzv-conf") or "")
                and "SLURM_NODEID" in environ):
            # c10d guesses whether to host the store from the host name; the step knows
            conf["is_host"] = str(int(environ["SLURM_NODEID"] == "0"))
    return added, conf


def requeue(environ: Mapping[str, str]) -> tuple[bool, str]:
    """Ask Slurm to requeue this job (the step's task 0 only; the others: nothing to do).
    Returns (whether asked and accepted, what happened in words)."""
    job = environ.get("SLURM_JOB_ID")
    if job is None or environ.get("SLURM_PROCID", "0") != "0":
        return False, ""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return False, (f"cannot requeue Slurm job {job}: scontrol is not on this node's PATH; "
                       "requeue it yourself (scontrol requeue JOBID)")
    try:
        run = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"scontrol requeue {job} failed: {e}"
    if run.returncode != 0:
        return False, (f"scontrol requeue {job} failed: {run.stderr.strip() or run.stdout}"
                       " (a job is requeued only where it allows it: sbatch --requeue, or "
                       "JobRequeue=1 in slurm.conf)")
    return True, f"Slurm job {job} requeued (scontrol requeue {job})"

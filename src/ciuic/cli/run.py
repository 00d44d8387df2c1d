"""``ciuic run``: supervise a training command (:mod:`ciuic.supervisor`). Imports no torch."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

import click

from ciuic.cli.app import app, size_text
from ciuic.errors import ConfigurationError
from ciuic.supervisor import slurm
from ciuic.supervisor.fleet import NodeSpec
from ciuic.words import counted

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b|%)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def host_memory_budget(text: str) -> int | None:
    """``--host-memory``: bytes (``64G``, ``512MiB``, ``1e9`` as a plain number), a share of
    this machine's memory (``50%``), or ``off``/``0`` (no host-memory tier)."""
    if text.strip().lower() in ("off", "0", "none", "no"):
        return None
    m = _SIZE.match(text)
    if not m:
        raise ConfigurationError(f"--host-memory {text!r}: give a size (64G, 512M), a share of "
                                 "this machine's memory (50%), or off")
    value, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "%":
        if not 0 < value <= 100:
            raise ConfigurationError(f"--host-memory {text!r}: a share is between 0 and 100 %")
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * value / 100)
    return int(value * _UNITS[unit[:1]])


# the command is what follows ``--`` or the first word that is not an option; an unknown option
# before it is a typo, refused with click's "No such option" (it was run as the command)
@app.command("run", context_settings={"allow_extra_args": True,
                                      "allow_interspersed_args": False},
             options_metavar="[OPTIONS] -- COMMAND [ARGS]...")
@click.option("--max-restarts", type=click.IntRange(min=0), default=10, metavar="N",
              help="Restart the job at most N times.")
@click.option("--hang-timeout", type=click.FloatRange(min=0), default=600.0, metavar="SECONDS",
              help="A rank that makes no step() for this long, while not restoring, saving or "
                   "waiting for a snapshot, is hung: the job is stopped and restarted. 0: off.")
@click.option("--startup-timeout", type=click.FloatRange(min=0), default=0.0, metavar="SECONDS",
              help="Also restart a start whose manager sends no heartbeat within this long "
                   "(0: wait as long as it takes).")
@click.option("--grace", type=click.FloatRange(min=0), default=30.0, metavar="SECONDS",
              help="After SIGTERM to a hung job, wait this long before SIGKILL.")
@click.option("--max-stalls", type=click.IntRange(min=1), default=3, metavar="N",
              help="Give up after N failures in a row that committed no snapshot past the "
                   "latest one.")
@click.option("--backoff", type=click.FloatRange(min=0), default=1.0, metavar="SECONDS",
              help="The first wait before restarting a job that made no progress; it doubles "
                   "with each such failure (a job that committed a snapshot restarts at once).")
@click.option("--host-memory", default="50%", metavar="SIZE",
              help="Keep the latest snapshot's bytes in host memory, up to SIZE (64G, 50%), so "
                   "that a restart restores from memory; off: from the store.")
@click.option("--replicas", type=click.IntRange(min=0), default=1, metavar="K",
              help="A job of several nodes: keep a copy of this node's part of the latest "
                   "snapshot in the memory of the next K nodes, so that a node that is lost "
                   "restores from a peer's memory (0: off). It counts in their --host-memory.")
@click.option("--peer-timeout", type=click.FloatRange(min=1), default=10.0, metavar="SECONDS",
              help="A job of several nodes: when another node's ciuic run does not answer for "
                   "this long (a network fault, a node powered off), stop this node's workers "
                   "so that torchrun restarts them instead of waiting in their collectives; "
                   "with --nproc-per-node, the node is lost (its ranks go to a spare node).")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None, metavar="N",
              help="Start N ranks of the command here, in place of torchrun, and recover from "
                   "a rank's fault in the other ranks' processes: a function wrapped in "
                   "ciuic.recoverable is called again (docs/recovery.md).")
@click.option("--spares", type=click.IntRange(min=0), default=0, metavar="K",
              help="With --nproc-per-node: keep K warm spares (the command started, its "
                   "imports done) to take a lost rank's place.")
@click.option("--nnodes", type=click.IntRange(min=1), default=None, metavar="M",
              help="With --nproc-per-node: the job's nodes, one ciuic run on each; node 0 "
                   "leads (it hosts the control store), a node lost goes to a spare node. "
                   "Under srun: the step's nodes.")
@click.option("--node-rank", type=click.IntRange(min=0), default=None, metavar="K",
              help="With --nnodes: this node's rank (0 .. M-1; M or more: a spare node, whose "
                   "warm spares take a lost node's ranks). Under srun: SLURM_NODEID.")
@click.option("--master-addr", default=None, metavar="HOST",
              help="With --nnodes: node 0's address, as the other nodes reach it. Under "
                   "srun: the step's first host.")
@click.option("--master-port", type=click.IntRange(min=1, max=65535), default=29500,
              metavar="PORT", help="With --nnodes: the port of node 0's control store.")
@click.pass_context
def run(ctx: click.Context, max_restarts: int, hang_timeout: float, startup_timeout: float,
        grace: float, max_stalls: int, backoff: float, host_memory: str, replicas: int,
        peer_timeout: float, nproc_per_node: int | None, spares: int, nnodes: int | None,
        node_rank: int | None, master_addr: str | None, master_port: int) -> None:
    """Run a training command, restart it when it fails or hangs, resume it from host memory.

    \b
    Usage: ciuic run [OPTIONS] -- COMMAND [ARGS...], e.g.
    ciuic run --hang-timeout 300 -- torchrun --nproc-per-node 8 train.py
    On several nodes, one on each (docs/multinode.md):
    ciuic run -- torchrun --nnodes 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 ...

    A torchrun of several nodes with the c10d rendezvous gets --rdzv-conf
    keep_alive_interval=2,keep_alive_max_attempt=3 added (torch's default is 5 and 3): the
    survivors of a lost node restart after about 6 s of its silence instead of 15 s. A
    --rdzv-conf that sets either is left as it is. Its environment gets
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where it does not set it: with torch's shared
    rendezvous store a node that replaces a lost one waits 60 s and every torchrun exits.

    \b
    Under Slurm (one ciuic run per node, srun --ntasks-per-node=1), a torchrun that says no
    rendezvous gets --nnodes, --rdzv-backend c10d, --rdzv-endpoint FIRST_NODE:29400,
    --rdzv-id and is_host from the job step. SIGUSR1 (--signal=USR1@T, scancel
    --signal=USR1) is a preemption notice: every rank takes its emergency snapshot, and the
    job is requeued (scontrol requeue; sbatch --requeue).
    """
    from ciuic.supervisor.agent import Supervisor
    from ciuic.supervisor.starts import Options

    if not hasattr(os, "memfd_create"):
        raise ConfigurationError("ciuic run needs Linux (memfd and abstract Unix sockets); on "
                                 "this system, restart the job yourself: restore() resumes it")
    command = list(ctx.args)
    if not command:
        raise ConfigurationError("ciuic run needs the command to run: ciuic run [OPTIONS] -- "
                                 "python train.py")
    import logging

    budget = host_memory_budget(host_memory)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    log = logging.getLogger("ciuic.run")
    log.addHandler(handler)
    # CIUIC_RUN_LOG=debug: also what changes nothing (each replica sent, docs/multinode.md)
    log.setLevel(logging.DEBUG if os.environ.get("CIUIC_RUN_LOG", "").lower() == "debug"
                 else logging.INFO)
    log.propagate = False
    logging.getLogger("ciuic").addHandler(handler)  # the channel's warnings
    log.info("ciuic run: %s (restarts at most %d, hang timeout %s, host memory %s)",
             " ".join(command), max_restarts, f"{hang_timeout:g} s" if hang_timeout else "off",
             size_text(budget) if budget is not None else "off")
    if nproc_per_node is not None:
        if _torchrun_at(command) is not None:
            raise ConfigurationError("--nproc-per-node starts the ranks itself: give the "
                                     "training script (ciuic run --nproc-per-node 4 -- python "
                                     "train.py), not torchrun")
        from ciuic.supervisor.starts import Options

        options = Options(command, max_restarts=max_restarts,
                          hang_timeout_s=hang_timeout or None, grace_s=grace,
                          max_stalls=max_stalls, host_memory=budget, replicas=replicas,
                          peer_timeout_s=peer_timeout)
        nnodes, node_rank, master_addr, slurm_said = slurm.node_args(
            os.environ, nnodes, node_rank, master_addr)
        if slurm_said:
            log.info("ciuic run: %s", slurm_said)
        spec = node_spec(nnodes, node_rank, master_addr, master_port)
        log.info("ciuic run: %s here%s, recovered in their processes (%s)",
                 counted(nproc_per_node, "rank"), "" if spec is None else
                 f" (node {spec.node_rank} of {nnodes})" if not spec.spare else
                 f" once this spare node takes a lost node's place (of {nnodes})",
                 counted(spares, "warm spare") if spares else "no warm spare")
        if spec is None:
            from ciuic.supervisor.launch import launch

            raise click.exceptions.Exit(launch(options, nproc_per_node, spares))
        from ciuic.supervisor.follow import launch_nodes

        raise click.exceptions.Exit(launch_nodes(options, nproc_per_node, spares, spec))
    elif spares:
        raise ConfigurationError("--spares takes --nproc-per-node: warm spares wait for a "
                                 "rank's place in a job ciuic run starts itself")
    elif nnodes is not None or node_rank is not None or master_addr:
        raise ConfigurationError("--nnodes, --node-rank and --master-addr take "
                                 "--nproc-per-node (ciuic run starts the ranks itself); a "
                                 "torchrun job of several nodes gives them to torchrun: "
                                 "ciuic run -- torchrun --nnodes 4 ...")
    command, slurm_said = with_slurm(command, os.environ)
    if slurm_said:
        log.info("ciuic run: %s", slurm_said)
    advice = torchrun_advice(command)
    if advice:
        log.warning("ciuic run: %s", advice)
    command, added = with_keep_alive(command)
    if added:
        log.info("ciuic run: %s", added)
    elastic = elastic_note(command)
    if elastic:
        log.info("ciuic run: %s", elastic)
    env, said = torchrun_env(command, os.environ)
    if said:
        (log.info if env else log.warning)("ciuic run: %s", said)
    options = Options(command, env=env, max_restarts=max_restarts,
                      hang_timeout_s=hang_timeout or None,
                      startup_timeout_s=startup_timeout or None, grace_s=grace,
                      backoff_s=backoff, max_stalls=max_stalls, host_memory=budget,
                      replicas=replicas, peer_timeout_s=peer_timeout,
                      worker_restarts=torchrun_restarts(command))
    raise click.exceptions.Exit(Supervisor(options).run())


#: torch's c10d rendezvous keeps a lost node's place until its keep-alive lapses, interval x
#: attempts (torch's default 5 s x 3): the survivors wait that long before they restart. What
#: ``ciuic run`` passes in ``--rdzv-conf`` where a torchrun of several nodes sets neither
#: (docs/multinode.md, "The rendezvous keep-alive": measured, and why this margin).
KEEP_ALIVE = {"keep_alive_interval": "2", "keep_alive_max_attempt": "3"}


def _torchrun_at(command: list[str]) -> int | None:
    """Where torchrun is in ``command`` (``torchrun`` or ``-m torch.distributed.run``)."""
    for i, arg in enumerate(command):
        if arg.endswith("torchrun") or arg == "torch.distributed.run":
            return i
    return None


def _option(args: list[str], name: str) -> tuple[int, str] | None:
    """(index, value) of the last ``--name VALUE`` / ``--name=VALUE`` (or its snake_case
    spelling) in torchrun's own arguments ``args`` (those before the training script)."""
    found = None
    for i, arg in enumerate(args):
        if arg.endswith(".py") and not arg.startswith("-"):
            break  # the training script: what follows is its own
        for spelled in (name, "--" + name[2:].replace("-", "_")):
            if arg == spelled and i + 1 < len(args):
                found = (i + 1, args[i + 1])
            elif arg.startswith(spelled + "="):
                found = (i, arg.split("=", 1)[1])
    return found


def torchrun_restarts(command: list[str]) -> int | None:
    """torchrun's own ``--max-restarts`` of its workers where ``command`` runs torchrun (0
    when not given, torchrun's default); None where it does not, or the value is not a
    number."""
    at = _torchrun_at(command)
    if at is None:
        return None
    value = (_option(command[at + 1:], "--max-restarts") or (0, "0"))[1]
    return int(value) if value.isdigit() else None


def _c10d_nodes(command: list[str]) -> tuple[int, list[str]] | None:
    """(where torchrun is, its arguments) where ``command`` runs torchrun on several nodes
    with the c10d rendezvous; else None."""
    at = _torchrun_at(command)
    if at is None:
        return None
    args = command[at + 1:]
    nnodes = (_option(args, "--nnodes") or (0, "1"))[1]
    several = nnodes.split(":")[-1].isdigit() and int(nnodes.split(":")[-1]) > 1
    backend = (_option(args, "--rdzv-backend") or (0, "static"))[1]
    return (at, args) if several and backend == "c10d" else None


#: torch (2.13 here) shares the c10d rendezvous's TCPStore between the agents and the workers
#: unless this variable is "1"; shared, the rank-0 agent publishes the workers' MASTER_ADDR only
#: at its first rendezvous, and after a node is replaced both agents wait 60 s for a key of the
#: new round and exit (``DistStoreError: wait timeout after 60000ms``): every torchrun is
#: started again (tests/test_multinode.py saw it). What ``ciuic run`` sets for a torchrun of
#: several nodes with the c10d rendezvous, where the environment does not set it.
SHARED_STORE_OFF = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def torchrun_env(command: list[str], environ: Mapping[str, str]
                 ) -> tuple[dict[str, str], str | None]:
    """What ``command``'s environment needs beyond ``environ`` (:data:`SHARED_STORE_OFF` for a
    torchrun of several nodes with the c10d rendezvous), and a line saying so; or, where
    ``environ`` sets that variable otherwise, nothing and a line saying what that costs."""
    if _c10d_nodes(command) is None:
        return {}, None
    name, value = SHARED_STORE_OFF
    given = environ.get(name)
    if given is None:
        return {name: value}, (f"torchrun runs on several nodes: {name}={value} is set in its "
                               "environment (torch's agents then give each rendezvous round "
                               "its own store keys; shared, a node that replaces a lost one "
                               "waits 60 s for a key of the first round, and every node's "
                               "torchrun exits with DistStoreError)")
    if given != value:
        return {}, (f"{name}={given} in the environment: with torch's shared rendezvous "
                    "store a node that replaces a lost one waits 60 s for a key of the first "
                    "round, and every node's torchrun exits with DistStoreError (ciuic run "
                    f"then starts them all again); unset it, or set {name}={value}")
    return {}, None


def with_rdzv_conf(command: list[str], pairs: dict[str, str]) -> list[str]:
    """``command`` (a torchrun) with ``pairs`` added to its ``--rdzv-conf`` (one given is
    extended, not replaced: torchrun takes only the last)."""
    at = _torchrun_at(command)
    assert at is not None and pairs
    args = command[at + 1:]
    conf = _option(args, "--rdzv-conf")
    added = ",".join(f"{k}={v}" for k, v in pairs.items())
    if conf is None:
        args = ["--rdzv-conf", added, *args]
    else:
        i, value = conf
        joined = f"{value},{added}" if value else added
        args[i] = joined if args[i] == value else args[i].split("=", 1)[0] + "=" + joined
    return [*command[:at + 1], *args]


def _rdzv_conf(args: list[str]) -> dict[str, str]:
    """The ``key=value`` pairs of torchrun's ``--rdzv-conf`` in its arguments ``args``."""
    conf = _option(args, "--rdzv-conf")
    return {} if conf is None else dict(kv.split("=", 1) for kv in conf[1].split(",")
                                        if "=" in kv)


def with_keep_alive(command: list[str]) -> tuple[list[str], str | None]:
    """``command`` with :data:`KEEP_ALIVE` added to its ``--rdzv-conf`` where it runs torchrun
    on several nodes with the c10d rendezvous and sets neither of the two itself (a value the
    user gave is never changed), and a line saying what was added (None: nothing)."""
    found = _c10d_nodes(command)
    if found is None:
        return command, None
    if set(KEEP_ALIVE) & set(_rdzv_conf(found[1])):
        return command, None
    added = ",".join(f"{k}={v}" for k, v in KEEP_ALIVE.items())
    lapse = int(KEEP_ALIVE["keep_alive_interval"]) * int(KEEP_ALIVE["keep_alive_max_attempt"])
    said = (f"torchrun's c10d rendezvous gets --rdzv-conf {added}: a lost node's place is "
            f"freed after {lapse} s without its keep-alive instead of torch's 15 s (set either "
            "in --rdzv-conf to choose)")
    return with_rdzv_conf(command, KEEP_ALIVE), said


def elastic_note(command: list[str]) -> str | None:
    """What a torchrun of ``--nnodes MIN:MAX`` (MIN < MAX, the c10d rendezvous) does when a
    node is lost with none to replace it, and how long the others wait; None otherwise."""
    found = _c10d_nodes(command)
    if found is None:
        return None
    nnodes = (_option(found[1], "--nnodes") or (0, ""))[1].split(":")
    if len(nnodes) != 2 or not all(n.isdigit() for n in nnodes) or int(nnodes[0]) >= int(
            nnodes[1]):
        return None
    last_call = _rdzv_conf(found[1]).get("last_call_timeout")
    waits = (f"its last call ({last_call} s, --rdzv-conf last_call_timeout)" if last_call else
             "its last call (torch's 30 s; --rdzv-conf last_call_timeout=SECONDS to choose)")
    return (f"the job runs on {nnodes[0]} to {nnodes[1]} nodes: a node lost with none to "
            "replace it, the others go on without it once torchrun's rendezvous has dropped "
            f"it (its keep-alive lapsed) and {waits} has passed; each rank then restores the "
            "last snapshot resharded onto the ranks left, from memory where the nodes hold "
            "it (the lost node's from its replica on another node), and a split "
            "ResumableSampler shares out the rest of the epoch")


def with_slurm(command: list[str], environ: Mapping[str, str]) -> tuple[list[str], str | None]:
    """Under ``srun``, ``command``'s torchrun with the rendezvous a Slurm step implies where
    it says none (:func:`ciuic.supervisor.slurm.torchrun_args`), and a line saying what was
    added (None: nothing)."""
    at = _torchrun_at(command)
    if at is None or not slurm.in_step(environ):
        return command, None
    args = command[at + 1:]
    own = args[:next((i for i, a in enumerate(args) if a.endswith(".py")), len(args))]
    if "--standalone" in own:  # one node, by the user's choice
        return command, None
    given = {name: (found[1] if (found := _option(args, name)) else None)
             for name in ("--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
                          "--rdzv-conf")}
    added, conf = slurm.torchrun_args(environ, given)
    command = [*command[:at + 1], *added, *args]
    if conf:
        command = with_rdzv_conf(command, conf)
    words = [f"{a} {b}" for a, b in zip(added[::2], added[1::2], strict=True)]
    words += [f"--rdzv-conf {k}={v}" for k, v in conf.items()]
    if not words:
        return command, None
    return command, (f"Slurm job {environ.get('SLURM_JOB_ID')}, node "
                     f"{environ.get('SLURM_NODEID', '?')} of the step: torchrun gets "
                     f"{', '.join(words)}")


def torchrun_advice(command: list[str]) -> str | None:
    """What to change in a torchrun command of several nodes, or None: without restarts of its
    own, torchrun gives up at the first failed worker and every node's torchrun is started
    again, a new rendezvous from scratch, where it could restart its workers in place."""
    def value(name: str) -> str | None:
        for i, arg in enumerate(command):
            for spelled in (name, "--" + name[2:].replace("-", "_")):
                if arg == spelled and i + 1 < len(command):
                    return command[i + 1]
                if arg.startswith(spelled + "="):
                    return arg.split("=", 1)[1]
        return None

    if not any(a.endswith(("torchrun", "torch.distributed.run")) for a in command):
        return None
    nnodes = value("--nnodes") or "1"
    several = ":" in nnodes or (nnodes.isdigit() and int(nnodes) > 1)
    if several and (value("--max-restarts") or "0") == "0":
        return ("torchrun runs on several nodes with --max-restarts 0: a failed worker stops "
                "it, and ciuic run then starts every node's torchrun again; give torchrun "
                "--max-restarts N (e.g. 100) so that it restarts the workers in place, "
                "re-rendezvousing with the other nodes")
    return None


def node_spec(nnodes: int, node_rank: int | None, master_addr: str | None,
              master_port: int) -> NodeSpec | None:
    """This node among the job's, from ``ciuic run --nproc-per-node``'s options; None: one
    node and no spare node (none of --nnodes, --node-rank, --master-addr)."""
    if nnodes == 1 and not node_rank and master_addr is None:
        return None
    if node_rank is None:
        raise ConfigurationError(f"--nnodes {nnodes}: give each node its --node-rank (0 on "
                                 f"the node at --master-addr, which leads; 1 to {nnodes - 1} "
                                 f"on the others; {nnodes} or more on a spare node)")
    if not master_addr:
        raise ConfigurationError(f"--nnodes {nnodes}: give --master-addr, node 0's address as "
                                 "the other nodes reach it (and the same --master-port on "
                                 "every node)")
    return NodeSpec(nnodes, node_rank, master_addr, master_port)

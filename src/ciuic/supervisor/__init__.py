"""``ciuic run``: a supervisor that runs a training command, tells why it stopped, restarts it,
and keeps the latest snapshot's bytes in host memory that outlives the training process.

Level 2 of the layers (``scripts/layout.py``): it imports only the foundation modules, so that
the manager (which reports to it) and the CLI (which runs it) may both import it, and so that
the supervisor itself never imports torch. Only :mod:`~ciuic.supervisor.hostcopy`, which the
training process uses, imports torch.

- :mod:`~ciuic.supervisor.beat`: each rank's heartbeat, one memory-mapped slot per rank;
- :mod:`~ciuic.supervisor.channel`: the local channel (an abstract Unix socket) between the
  supervisor and the training processes, and the memory it holds for them;
- :mod:`~ciuic.supervisor.hostcopy`: the training side of the host-memory tier;
- :mod:`~ciuic.supervisor.causes`: why a run stopped;
- :mod:`~ciuic.supervisor.agent`: the loop that starts, watches and restarts the job.
"""

"""The snapshot chain in a store: the repository (a store plus its catalog), the write path in
commit order, verified reads of manifests, bodies and chunks, leases and fencing, retention and
gc, ``ciuic verify``, copies between stores, and how runs end.

May import: ``format``, ``store``, ``catalog``, ``engine`` (the compression decision), ``state``
(what a capture is), and the foundation modules (``errors``, ``knobs``, ``faults``,
``threads``).
"""

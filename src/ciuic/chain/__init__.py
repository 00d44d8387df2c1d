"""The snapshot chain in a store: the repository (a store plus its catalog), the write path in
commit order, verified reads of manifests, bodies and chunks, leases and fencing, retention and
gc, ``ciuic verify``, copies between stores, how runs end, and what ``ciuic ls`` and ``ciuic
log`` read of a local catalog without SQLAlchemy (``listing``; ``home`` and ``runs`` import no
SQLAlchemy either).

May import: ``format``, ``store``, ``catalog``, ``engine`` (the compression decision), ``state``
(what a capture is), and the foundation modules (``errors``, ``knobs``, ``faults``,
``threads``).
"""

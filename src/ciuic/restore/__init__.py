"""Reading snapshots back into values and live objects: tensor leaves read straight into their
memory, from the store, ``ciuic run``'s host-memory copy or lent buffers (``sources``); a
snapshot checked against the live objects before anything is read (``match``) and read into
their tensors (``inplace``, ``local``); boxes of sharded tensors for any world size
(resharding); ``ciuic restore --to`` exports and ``ciuic diff``.

May import: ``chain``, ``state``, ``engine``, ``supervisor``, ``format``, ``store`` and the
foundation modules.
"""

"""The on-disk contract, with no I/O: store keys (:mod:`~ciuic.format.layout`), canonical JSON,
BLAKE3 digests, the tagged value tree, chunk frames, manifests and bodies, sharded descriptors,
the float codec, and encryption framing. docs/format.md is its specification. Also the catalog's
rows, below both of its readers (:mod:`~ciuic.format.info`: a snapshot's;
:mod:`~ciuic.format.records`: a job's, a run's, a run event's, a run's report to a server).

May import: ``ciuic.errors`` only. Everything else in ciuic builds on it.
"""

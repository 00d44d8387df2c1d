"""The on-disk contract, with no I/O: store keys (:mod:`~ciuic.format.layout`), canonical JSON,
BLAKE3 digests, the tagged value tree, chunk frames, manifests and bodies, sharded descriptors,
the float codec, and encryption framing. docs/format.md is its specification.

May import: ``ciuic.errors`` only. Everything else in ciuic builds on it.
"""

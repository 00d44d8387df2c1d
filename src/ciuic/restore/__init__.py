"""Reading snapshots back into values: tensor leaves read straight into their memory, boxes of
sharded tensors for any world size (resharding), and ``ciuic restore --to`` exports.

May import: ``chain``, ``format``, ``store`` and the foundation modules.
"""

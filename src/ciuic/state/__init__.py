"""Capturing training state: model, optimizer, RNG and extras to trees of values and tensor
leaves (references, no copies), and the RNG state set back; the resumable sampler (the data
position); ``StateHolder`` for plain state; one DDP gradient bucket layout for every run
(``ddp``). Checking a snapshot against live objects and loading
it into them is :mod:`ciuic.restore`'s.

May import: ``format`` and the foundation modules.
"""

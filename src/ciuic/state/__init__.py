"""Capturing training state and putting it back: model, optimizer, RNG and extras to trees of
values and tensor leaves (references, no copies); the resumable sampler (the data position);
``StateHolder`` for plain state.

May import: ``format`` and the foundation modules.
"""

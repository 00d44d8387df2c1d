"""Adapters for training frameworks (Hugging Face Trainer, Lightning, Accelerate, DeepSpeed), one
small module each, each an optional extra: ``import ciuic`` imports none of them, and none of
them is imported unless a user imports it.

May import: ``manager`` and everything below it; the framework itself only inside its own module.
"""

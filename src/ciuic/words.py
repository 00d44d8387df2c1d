"""Counts in words, for the messages users read: ``counted(1, "chunk")`` is ``1 chunk``,
``counted(3, "chunk")`` is ``3 chunks`` (never ``chunk(s)``)."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, in the plural (``plural``, else ``noun`` + "s") unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


__all__ = ["counted"]

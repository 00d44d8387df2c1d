"""Counts in words, for the messages users read: ``counted(1, "chunk")`` is ``1 chunk``,
``counted(3, "chunk")`` is ``3 chunks`` (never ``chunk(s)``); ``listed([1, 3], "rank")`` is
``ranks 1, 3``; a list of reasons said in one short line (:func:`reasons_in_short`)."""

from __future__ import annotations

from collections.abc import Sequence


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, in the plural (``plural``, else ``noun`` + "s") unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def listed(items: Sequence[object], noun: str, plural: str | None = None,
           most: int | None = None) -> str:
    """``noun`` and ``items``, in the plural (``plural``, else ``noun`` + "s") unless there is
    one: ``rank 1``, ``ranks 1, 3``; past ``most`` items, the first ``most`` and how many
    more."""
    shown = items if most is None else items[:most]
    more = f" and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    word = noun if len(items) == 1 else plural or noun + "s"
    return f"{word} {', '.join(map(str, shown))}{more}"


def reasons_in_short(reasons: Sequence[str], ref: str) -> str:
    """Why snapshot ``ref`` (``PROJECT/JOB@STEP``) is unhealthy, in one short line: the first
    reason (two if they are short), how many more, and the ``ciuic inspect`` that lists them
    all (the health warning at its commit, ``ciuic show``)."""
    shown = 2 if len(reasons) > 1 and len(reasons[0]) + len(reasons[1]) <= 120 else 1
    text = "; ".join(reasons[:shown])
    more = len(reasons) - shown
    if more:
        return f"{text}; and {counted(more, 'more reason')} (`ciuic inspect {ref}` lists them all)"
    return f"{text} (`ciuic inspect {ref}` shows its tensors)"


__all__ = ["counted", "listed", "reasons_in_short"]

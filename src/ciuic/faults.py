"""Failpoints: named places in the write path where tests make the process die or fail.

Off and free in normal runs. Enabled through ``CIUIC_FAILPOINTS`` (read at import and by
:func:`reload`), a comma-separated list of ``NAME=ACTION`` where ACTION is ``kill`` (SIGKILL
the process), ``raise`` (an I/O error), ``kill@N`` / ``raise@N`` (only on the N-th hit,
counting from 1), or ``sleep:SECONDS`` (slow the step down, so that kills from outside land
inside saves). Names, in write order: ``chunk.put``, ``chunks.sync``, ``body.put``,
``manifest.create``, ``catalog.insert``; and ``body.delete`` (a prune's).
"""

from __future__ import annotations

import os
import signal
import time

from ciuic.errors import StoreError

_rules: dict[str, tuple[str, int]] = {}
_hits: dict[str, int] = {}


def reload(spec: str | None = None) -> None:
    """(Re)read the failpoint spec from ``spec`` or the environment."""
    _rules.clear()
    _hits.clear()
    text = os.environ.get("CIUIC_FAILPOINTS", "") if spec is None else spec
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, action = item.partition("=")
        if action.startswith("sleep:"):
            _rules[name] = (action, 0)
            continue
        what, _, nth = action.partition("@")
        if what not in ("kill", "raise"):
            raise ValueError(f"CIUIC_FAILPOINTS: unknown action {action!r} for {name!r}")
        _rules[name] = (what, int(nth) if nth else 0)


def failpoint(name: str) -> None:
    if not _rules:
        return
    rule = _rules.get(name)
    if rule is None:
        return
    _hits[name] = _hits.get(name, 0) + 1
    what, nth = rule
    if what.startswith("sleep:"):
        time.sleep(float(what.split(":", 1)[1]))
        return
    if nth and _hits[name] != nth:
        return
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise StoreError(f"failpoint {name}: injected I/O error")


reload()

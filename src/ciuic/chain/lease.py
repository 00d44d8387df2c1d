"""Who may commit to a job: a lease with a fencing token.

A process that opens a job takes the next token by creating ``jobs/<p>/<j>/leases/<token>.json``
(create-if-absent, so two starters never get the same token). Tokens compare as numbers (the
key of token 10**12 sorts before 999999999999's). Before every commit the writer
checks, under the store's commit lock for the job, that no lease with a higher token exists; a
process that was replaced (a restarted job while the old process still runs) is *fenced out*:
its commits are refused with :class:`FencedOut`, and it says what happened and what to do.

On stores with a real lock (the local directory, the in-memory store) the check and the commit
are atomic with respect to a takeover. Stores without one (``Store.lock`` is a no-op) fall back
to check-then-commit: a takeover that lands between the two lets at most that one in-flight
commit of the old process through, which is then an ordinary snapshot of the old lineage.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from ciuic.chain.runs import IDENTITY
from ciuic.errors import CorruptObject, FencedOut, ObjectNotFound
from ciuic.format import canonical, layout
from ciuic.store import Store


@dataclass(frozen=True)
class Lease:
    project: str
    job: str
    token: int
    run_id: str

    @property
    def key(self) -> str:
        return layout.lease_key(self.project, self.job, self.token)


def _holder(run_id: str) -> bytes:
    return json.dumps({**IDENTITY, "pid": os.getpid(), "run": run_id,
                       "time": time.time()}).encode()


def acquire(store: Store, project: str, job: str, run_id: str) -> Lease:
    """Take the next token for the job (every later commit of an older token is refused)."""
    with store.lock(layout.commit_lock_name(project, job)):
        newest = layout.newest_lease(store.list(layout.leases_prefix(project, job)))
        token = layout.lease_token(newest) + 1 if newest else 1
        while not store.create(layout.lease_key(project, job, token), _holder(run_id)):
            token += 1
    return Lease(project, job, token, run_id)


def check(store: Store, lease: Lease) -> None:
    """Raise :class:`FencedOut` if a newer lease exists (call under the commit lock)."""
    newest = layout.newest_lease(store.list(layout.leases_prefix(lease.project, lease.job)))
    if newest is None or layout.lease_token(newest) <= lease.token:
        return
    info = _read(store, newest) or {}
    at = info.get("time")
    since = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
             if isinstance(at, (int, float)) and 0 <= at < 1e11 else "an unknown time")
    raise FencedOut(
        f"another process took over job {lease.project}/{lease.job} at {since} (pid "
        f"{info.get('pid', '?')} on {info.get('host', '?')}, run {info.get('run', '?')}); this "
        f"process (run {lease.run_id}) may no longer commit snapshots. Stop this process: the "
        "job continues in the newer one, and this process's committed snapshots are kept."
    )


def _read(store: Store, key: str) -> dict[str, Any] | None:
    try:
        value = canonical.parse(store.get(key), key, "lease", floats=True)
    except (ObjectNotFound, CorruptObject):
        return None
    return value if isinstance(value, dict) else None

"""Garbage collection of unreferenced chunks and bodies, safe against concurrent saves.

Protocol (docs/format.md, "Garbage collection"):

* a save first creates ``inflight/<token>.json``, then checks for ``locks/gc.json``; if the lock
  exists it deletes its marker, waits for the lock to go, and starts again;
* ``gc`` creates ``locks/gc.json`` (create-if-absent), then waits until no live in-flight marker
  remains, bumps ``locks/gc-epoch.json``, computes what every manifest and body still references,
  deletes the rest, and removes its lock.

Either the save's marker exists before the lock (gc waits for the save), or the save sees the
lock (and waits for gc): a save never references a chunk that gc is deleting. A writer that
caches "chunks the store has" drops its cache when the epoch changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from ciuic import knobs
from ciuic.chain.read import body_keys, body_states, chunk_refs
from ciuic.chain.repo import Repository, list_manifests
from ciuic.chain.runs import IDENTITY, pid_alive
from ciuic.errors import CiuicError, IntegrityError, ObjectNotFound, StoreError, UnreadableObject
from ciuic.format import layout
from ciuic.format.layout import chunk_key, digest_of_key
from ciuic.store import LocalStore, Store
from ciuic.store.http import HttpStore
from ciuic.words import counted


def _marker() -> bytes:
    return json.dumps({**IDENTITY, "pid": os.getpid(), "time": time.time()}).encode()


def _is_live(store: Store, key: str, stale_s: float) -> bool:
    """Whether a marker or lock still belongs to a running process.

    On the same machine (same host, boot and PID namespace) the pid decides; elsewhere the
    marker's age does (its owner refreshes it while it works).
    """
    try:
        info = json.loads(store.get(key))
    except (ObjectNotFound, ValueError):
        return False
    same_machine = all(info.get(k) == v for k, v in IDENTITY.items()) and IDENTITY["pidns"]
    if same_machine and not pid_alive(int(info.get("pid", -1))):
        return False
    return bool(time.time() - float(info.get("time", 0)) < stale_s)


def read_epoch(store: Store) -> int:
    try:
        return int(json.loads(store.get(layout.GC_EPOCH))["epoch"])
    except ObjectNotFound:
        return 0
    except (ValueError, KeyError, TypeError):
        return -1


class InflightSave:
    """Marks a save in progress so that ``gc`` never deletes what it may reference."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.key = layout.inflight_key(f"{secrets.token_hex(12)}.json")
        self.epoch = 0

    def __enter__(self) -> InflightSave:
        deadline = time.monotonic() + knobs.get().gc_wait_s
        while True:
            # marker first, then look for the lock (see the module docstring for why)
            self.store.put(self.key, _marker())
            if not self.store.has(layout.GC_LOCK) or not _is_live(
                self.store, layout.GC_LOCK, knobs.get().gc_lock_stale_s
            ):
                self.epoch = read_epoch(self.store)
                return self
            self.store.delete(self.key)
            if time.monotonic() > deadline:
                raise StoreError(
                    "a `ciuic gc` has held the store's lock for too long; the snapshot was "
                    f"skipped. If no gc is running, delete {self.store.location(layout.GC_LOCK)}"
                )
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(CiuicError, OSError):
            self.store.delete(self.key)


def _size(store: Store, key: str) -> int:
    """An object's stored size, reading at most its first 16 bytes (0 when it went away)."""
    try:
        return store.get_into(key, [memoryview(bytearray(16))])
    except ObjectNotFound:
        return 0


@dataclass
class GcResult:
    deleted_chunks: int = 0
    deleted_bodies: int = 0
    deleted_bytes: int = 0  # the stored size of the chunks and bodies deleted
    deleted_markers: int = 0
    deleted_temporaries: int = 0
    kept_chunks: int = 0
    skipped: str = ""
    damaged: list[str] = field(default_factory=list)

    def add(self, other: GcResult) -> None:
        """Count ``other``'s (another store's gc) with these; a skip or damage in either is
        said."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, int):
                setattr(self, f.name, mine + theirs)
        self.skipped = "; ".join(x for x in (self.skipped, other.skipped) if x)
        self.damaged.extend(other.damaged)


def referenced(repo: Repository, progress: Callable[[str], None] | None = None
               ) -> tuple[set[str], set[str], list[str]]:
    """(chunk keys, body keys) referenced by every snapshot in the store, and damaged keys."""
    chunks: set[str] = set()
    bodies: set[str] = set()
    damaged: list[str] = []
    store = repo.store
    for mk in list_manifests(store):
        if progress:
            progress(mk.key)
        try:
            m = repo.read_manifest(mk.project, mk.job, mk.snapshot_id)
        except (UnreadableObject, ObjectNotFound):
            damaged.append(mk.key)
            continue
        bkey = layout.body_key(mk.project, mk.job, m.body)
        bodies.add(bkey)
        try:
            states = body_states(repo, m)
            bodies.update(body_keys(m, states))  # a split body's parts
            refs = chunk_refs(states)
        except UnreadableObject as e:
            if not store.has(bkey):
                continue  # pruned
            damaged.append(f"{bkey} ({e.reason})")
            continue
        except IntegrityError:
            damaged.append(bkey)
            continue
        chunks.update(chunk_key(d) for d in refs)
    return chunks, bodies, damaged


def _served(store: Store) -> HttpStore | None:
    """The server project under ``store``'s wrappers (retries), if it is one."""
    while not isinstance(store, HttpStore):
        inner = getattr(store, "inner", None)
        if not isinstance(inner, Store):
            return None
        store = inner
    return store


class _LockRefresher:
    """Re-writes the gc lock every ``gc_lock_refresh_s`` so that writers see it as live."""

    def __init__(self, store: Store, dry_run: bool) -> None:
        self.store, self.dry_run = store, dry_run
        self.last = time.monotonic()

    def __call__(self) -> None:
        if time.monotonic() - self.last >= knobs.get().gc_lock_refresh_s:
            self.store.put(layout.GC_LOCK, _marker())
            self.last = time.monotonic()


def collect(repo: Repository, *, dry_run: bool = False, wait_s: float = 0.0,
            progress: Callable[[str], None] | None = None) -> GcResult:
    """Delete chunks and bodies that no manifest references. See the module docstring. A
    project on a ciuic server is collected by the server (clients may not delete chunks)."""
    store = repo.store
    server = _served(store)
    if server is not None:
        return GcResult(**server.gc(dry_run, wait_s))
    result = GcResult()
    if not store.create(layout.GC_LOCK, _marker()):
        if _is_live(store, layout.GC_LOCK, knobs.get().gc_lock_stale_s):
            result.skipped = "another gc is running"
            return result
        store.put(layout.GC_LOCK, _marker())  # the previous gc died; take its lock over
    try:
        deadline = time.monotonic() + wait_s
        while True:
            live = []
            for key in list(store.list(layout.INFLIGHT)):
                if _is_live(store, key, knobs.get().inflight_stale_s):
                    live.append(key)
                elif not dry_run:
                    store.delete(key)
                    result.deleted_markers += 1
            if not live:
                break
            if time.monotonic() >= deadline:
                result.skipped = f"{counted(len(live), 'save')} in progress; run gc again later"
                return result
            time.sleep(0.1)
        if not dry_run:
            store.put(layout.GC_EPOCH, json.dumps({"epoch": read_epoch(store) + 1}).encode())
        keep_chunks, keep_bodies, result.damaged = referenced(repo, progress)
        if result.damaged:
            # A manifest or body we cannot read may reference anything: delete nothing.
            damaged = counted(len(result.damaged), "damaged or unreadable manifest or body",
                              "damaged or unreadable manifests or bodies")
            result.skipped = (f"{damaged} (a newer format, or corruption): gc deletes nothing "
                              "until `ciuic verify` is clean")
            return result
        refresh = _LockRefresher(store, dry_run)
        for key in list(store.list(layout.CHUNKS)):
            refresh()
            if key in keep_chunks:
                result.kept_chunks += 1
                continue
            digest_of_key(key)  # only ever delete well-formed chunk keys
            result.deleted_bytes += _size(store, key)
            if not dry_run:
                store.delete(key)
            result.deleted_chunks += 1
        for key in list(store.list(layout.JOBS)):
            if layout.parse_body(key) is not None and key not in keep_bodies:
                result.deleted_bytes += _size(store, key)
                if not dry_run:
                    store.delete(key)
                result.deleted_bodies += 1
        local = getattr(store, "inner", store)
        if isinstance(local, LocalStore) and not dry_run:
            result.deleted_temporaries = local.remove_temporaries(knobs.get().temp_stale_s)
        return result
    finally:
        store.delete(layout.GC_LOCK)

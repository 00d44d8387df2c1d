"""A repository: one object store plus the catalog that indexes it.

The embedded default is a directory (``$CIUIC_HOME``, else ``./.ciuic``) holding ``objects/``
(a :class:`~ciuic.store.LocalStore`) and ``catalog.db`` (SQLite).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from ciuic.catalog import Catalog
from ciuic.chain import home
from ciuic.chain.home import default_location
from ciuic.errors import (
    ConfigurationError,
    CorruptObject,
    IntegrityError,
    ObjectNotFound,
    SnapshotNotFound,
    StoreError,
    UnreadableObject,
)
from ciuic.format import chunks as ck
from ciuic.format import layout
from ciuic.format import manifest as mf
from ciuic.format.crypto import Keyring
from ciuic.format.digest import digest, is_digest
from ciuic.format.info import SnapshotInfo
from ciuic.store import LocalStore, Store, open_store
from ciuic.store.memory import MemoryStore
from ciuic.store.mirror import MirrorStore
from ciuic.store.prefix import PrefixStore
from ciuic.store.retry import RetryingStore
from ciuic.words import counted

log = logging.getLogger("ciuic")
T = TypeVar("T")
#: Manifests read at once when a job's catalog catches up with its store (each is a round trip
#: on an object store; a new machine's catalog reads every one of the job's)
READS = 16


def list_manifests(store: Store, project: str | None = None, job: str | None = None
                   ) -> list[layout.ManifestKey]:
    """Every manifest in a store, or in one project, or in one job (the one listing that gc,
    the repository, transfers, the server and the CLI use)."""
    if job is not None:
        if project is None:
            raise ValueError("list_manifests: a job needs its project")
        prefix = layout.manifests_prefix(project, job)
    else:
        prefix = layout.jobs_prefix(project)
    return [k for k in map(layout.parse_manifest, store.list(prefix)) if k is not None]


def list_jobs(store: Store, project: str | None = None) -> list[tuple[str, str]]:
    """(project, job) of every job with at least one manifest, sorted."""
    return sorted({(k.project, k.job) for k in list_manifests(store, project)})


def passphrase_salt(store: Store) -> bytes:
    """The store's random salt for passphrase-derived keys, created on first use
    (create-if-absent: every writer of the store derives the same key)."""
    store.create(layout.PASSPHRASE_SALT, secrets.token_bytes(16))
    return store.get(layout.PASSPHRASE_SALT)


def cached_catalog_url(store_url: str) -> str:
    """The local SQLite catalog (an index, rebuilt from the store when lost) of a remote store:
    ``$XDG_CACHE_HOME/ciuic/<hash of the URL>.db``."""
    tag = hashlib.sha256(store_url.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ciuic"
    return f"sqlite:///{cache / (tag + '.db')}"


class Repository:
    """A store and the catalog that indexes it: what every reader and writer of snapshots
    opens (:meth:`open`).

    A server's storage (``ciuic serve``) holds one store per project, ``projects/<name>/``,
    all indexed by the server's one catalog. Opened at its root (``ciuic --store /srv/ciuic``),
    the repository names its jobs across those stores (:meth:`jobs`); :meth:`scope` is the
    repository of one project's snapshots, and :meth:`sync_job` and :meth:`split_job` look in
    it. A project that a server keeps hides a job of the same project written at the root.
    """

    def __init__(self, store: Store, catalog: Catalog, *, project: str | None = None) -> None:
        self.store = store
        self.catalog = catalog
        self._keyring: Keyring | None = None
        #: how a person names this store in a message: the folder given for a local store
        #: (not its objects/ inside), else the store's URL
        self.name = store.url
        #: the project whose store (in a server's storage) this repository is; None: a root
        self.project = project
        self._served: dict[str, Repository] | None = None
        #: a local store that cannot be written, indexed by a catalog in the user's cache
        self.read_only = False
        #: objects another process read for this one (:meth:`preload`), by key
        self._preloaded: dict[str, bytes] = {}
        self._preload_lock = threading.Lock()

    @property
    def keyring(self) -> Keyring:
        """The keys configured in the environment (loaded on first use)."""
        if self._keyring is None:
            self._keyring = Keyring.from_env(lambda: passphrase_salt(self.store))
        return self._keyring

    def open_meta(self, key: str, blob: bytes) -> tuple[bytes, bytes | None]:
        """The plaintext of a manifest or body and the name key its digest uses (None: plain)."""
        if ck.is_framed(blob):
            plain, used = self.keyring.open(key, blob)
            return plain, used.name_key
        return blob, None

    @classmethod
    def open(cls, location: str | os.PathLike[str] | Store | None = None,
             catalog_url: str | None = None, *, mirror: str | Store | None = None,
             durability: str | None = None, writable: bool = False) -> Repository:
        """Open (creating if needed) the repository at ``location``: a directory, a URL, or a
        :class:`Store` instance (its catalog is then ``catalog_url``, or an in-process SQLite
        database shared by every opening of the same store). Every store is wrapped in a
        :class:`RetryingStore` (bounded retries, timeouts).

        ``mirror`` (or ``$CIUIC_MIRROR``): a second, durable tier (a URL such as
        ``s3://bucket/prefix``) that the store is mirrored to; ``durability`` (or
        ``$CIUIC_DURABILITY``, default ``"local"``) says which tier's write is the commit
        (:class:`~ciuic.store.mirror.MirrorStore`). ``writable``: refuse a local store that
        cannot be written (a reader opens one with its catalog in the user's cache)."""
        catalog_url = catalog_url or os.environ.get("CIUIC_CATALOG")
        mirror = mirror if mirror is not None else os.environ.get("CIUIC_MIRROR") or None
        durability = durability or os.environ.get("CIUIC_DURABILITY") or "local"
        if isinstance(location, Store):
            return cls._shared(location, catalog_url, mirror, durability)
        text = os.fspath(location) if location is not None else default_location()
        scheme = urlparse(text).scheme.lower()
        if scheme in ("", "file"):
            root = Path(urlparse(text).path if scheme == "file" else text).expanduser()
            if root.exists() and not root.is_dir():
                raise ConfigurationError(f"store location {root} exists and is not a directory")
            store: Store = LocalStore(root / "objects")
            url = catalog_url or f"sqlite:///{root.resolve() / 'catalog.db'}"
            unwritable = home.read_only(root)
            if unwritable and writable:
                raise ConfigurationError(
                    f"the store {root} cannot be written (a read-only file system, or no "
                    "permission), so no snapshot could be saved there: point store= or "
                    "CIUIC_HOME at a writable folder (`ciuic --store` can still read this one)")
            if catalog_url is None and unwritable:
                # a read-only store (a mounted copy, an archive) can still be read: its catalog
                # is an index of the store, rebuilt in the user's cache as for a remote store
                url = cached_catalog_url(f"file://{root.resolve()}")
                log.info("%s is read-only: indexing it in %s", root, url)
        elif scheme == "memory":
            return cls._shared(open_store(text), catalog_url, mirror, durability)
        else:
            store = open_store(text)
            url = catalog_url or cached_catalog_url(store.url)
        repo = cls(_tiers(store, mirror, durability), Catalog(url))
        if scheme in ("", "file"):
            repo.name = str(root)
            repo.read_only = catalog_url is None and unwritable
        if repo.catalog.recreated_from is not None:
            counts = repo.reindex()
            log.warning("the catalog was damaged; it was moved to %s and rebuilt from the store "
                        "(%s, %d pruned): nothing is lost, since the store is the truth; run "
                        "history before this point is in the damaged file",
                        repo.catalog.recreated_from, counted(counts["snapshots"], "snapshot"),
                        counts["pruned"])
        return repo

    @classmethod
    def _shared(cls, store: Store, catalog_url: str | None, mirror: str | Store | None,
                durability: str) -> Repository:
        wrapped = _tiers(store, mirror, durability)
        if catalog_url is not None:
            return cls(wrapped, Catalog(catalog_url))
        cached = _MEMORY_CATALOGS.get(store.url)
        if cached is None:
            cached = _MEMORY_CATALOGS[store.url] = Catalog("sqlite://")
        return cls(wrapped, cached)

    # -- a server's storage: one store per project ---------------------------------------

    def served(self, project: str) -> Repository:
        """The repository of ``project``'s store inside this one, ``projects/<project>/``
        (where a server keeps it), sharing this catalog."""
        if self.project is not None:
            raise ValueError(f"{self.name} is already the store of project {self.project}")
        scoped = Repository(PrefixStore(self.store, layout.project_prefix(project)),
                            self.catalog, project=project)
        scoped.name = f"{self.name}/{layout.project_prefix(project).rstrip('/')}"
        return scoped

    def _projects(self) -> dict[str, Repository]:
        """The projects a server keeps in this store, by name (listed once)."""
        if self._served is None:
            names = [] if self.project is not None else self.store.children(layout.PROJECTS)
            self._served = {n: self.served(n) for n in names if layout.is_name(n)}
        return self._served

    def scope(self, project: str) -> Repository:
        """The repository that holds ``project``'s snapshots: its store in a server's storage
        where this is one and the server keeps that project, else this repository."""
        return self._projects().get(project, self)

    def namespaces(self) -> list[Repository]:
        """This repository, then the store of every project a server keeps in it."""
        return [self, *self._projects().values()]

    def jobs(self) -> list[tuple[str, str]]:
        """(project, job) of every job with a manifest, in this store and in every project's
        store that a server keeps in it, sorted."""
        served = self._projects()
        found = {pj for pj in list_jobs(self.store) if pj[0] not in served}
        for project, repo in served.items():
            found.update(list_jobs(repo.store, project))
        return sorted(found)

    def preload(self, blobs: dict[str, bytes]) -> None:
        """Objects as another process read them from the store (a multi-rank restore's rank 0
        reads the manifest and the body once for every rank): the next read of each key gets
        its bytes, checked exactly as bytes from the store are (every such key names its
        content: the manifest's ID, the body's digest), and reads the store where they fail
        that check. ``{}`` drops what was not read."""
        with self._preload_lock:
            self._preloaded = dict(blobs)

    def preloaded(self, key: str) -> bytes | None:
        """The bytes :meth:`preload` gave for ``key`` (once), else None."""
        with self._preload_lock:
            return self._preloaded.pop(key, None)

    def read_verified(self, key: str, read: Callable[[Store], T]) -> T:
        """``read(store)`` from the nearest copy of ``key`` that is present and intact.

        ``read`` fetches and checks the object (raising :class:`ObjectNotFound` or an
        :class:`IntegrityError`); on a mirror, a copy that fails is skipped with a warning, the
        next tier is tried, and the good bytes are written back over the bad copy. With one
        tier this is just ``read(self.store)``.
        """
        given = self.preloaded(key)
        if given is not None:
            one = MemoryStore("preloaded")
            one.put(key, given)
            try:
                return read(one)
            except IntegrityError as e:  # damaged on its way here: the store's copy then
                log.debug("%s as another rank read it: %s; reading the store", key, e)
        copies = self.store.copies()
        first: Exception | None = None
        for i, tier in enumerate(copies):
            try:
                result = read(tier)
            except (IntegrityError, StoreError) as e:  # missing, damaged, or unreachable
                first = first or e
                if i + 1 < len(copies):
                    log.warning("%s is unusable in %s (%s); reading it from %s", key,
                                tier.url, e, copies[i + 1].url)
                continue
            for bad in copies[:i]:
                try:
                    bad.put(key, tier.get(key))
                except Exception as e:
                    log.warning("could not repair %s in %s: %s", key, bad.url, e)
            return result
        assert first is not None
        raise first

    def close(self) -> None:
        self.store.close()
        if self.catalog not in _MEMORY_CATALOGS.values():
            self.catalog.close()

    def location(self, key: str = "") -> str:
        return self.store.location(key)

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- manifests ---------------------------------------------------------------------------

    def read_manifest(self, project: str, job: str, snapshot_id: str) -> mf.Manifest:
        """Read a manifest and check that its bytes hash to its ID."""
        key = layout.manifest_key(project, job, snapshot_id)

        def read(store: Store) -> mf.Manifest:
            data, name_key = self.open_meta(key, store.get(key))
            actual = digest(data, key=name_key)
            if actual != snapshot_id:
                raise CorruptObject(key, f"manifest hashes to {actual[:16]}..., not to its ID")
            return mf.Manifest.decode(data, key)

        m = self.read_verified(key, read)
        if (m.project, m.job) != (project, job):
            raise CorruptObject(
                key, f"manifest belongs to {m.project}/{m.job}, not {project}/{job}")
        return m

    def manifest_ids(self, project: str, job: str) -> list[str]:
        """The IDs of the manifests the store lists for a job (in its project's store, in a
        server's storage)."""
        return [k.snapshot_id
                for k in list_manifests(self.scope(project).store, project, job)]

    def sync_job(self, project: str, job: str,
                 damaged: list[UnreadableObject] | None = None) -> int:
        """Make the catalog follow the store for one job: add rows for manifests it lacks, and
        mark pruned the snapshots whose body is gone. Returns how many rows were added; a
        manifest that cannot be read gets no row (``ciuic verify`` reports it), and its error is
        appended to ``damaged`` when given.

        A crash between the commit (manifest) and the catalog insert leaves the first gap; a
        body deleted through another catalog (another client's retention, a server's
        ``DELETE``, ``ciuic prune`` on another machine) the second. The store is the truth, so
        every catalog heals here, with one listing of the job's manifests and one of its bodies.

        Only a snapshot whose manifest the store lists and whose body it lacks is pruned (a
        prune deletes the body and keeps the manifest). A row whose manifest the store does not
        list at all is left as it is: the catalog is then read over another store than the one
        it indexes (a moved folder, a server's storage read at its root), not a pruned one.
        """
        repo = self.scope(project)
        if repo is not self:
            return repo.sync_job(project, job, damaged)
        rows = self.catalog.snapshots(project, job, status=None)
        known = {i.id for i in rows}
        with ThreadPoolExecutor(READS, thread_name_prefix="ciuic-sync") as pool:
            # the two listings at once: on an object store each is a round trip or more
            bodies_listed = pool.submit(lambda: list(self.store.list(
                layout.bodies_prefix(project, job))))
            listed = self.manifest_ids(project, job)
            bodies = {b[2] for b in map(layout.parse_body, bodies_listed.result())
                      if b is not None}
            new = [sid for sid in listed if sid not in known]
            read = dict(zip(new, pool.map(lambda sid: self._try_manifest(project, job, sid),
                                          new), strict=True))
        partial = len(self.store.copies()) > 1  # a mirror lists its fast tier only
        foreign = [row for row in rows if row.id not in listed]
        if foreign and len(foreign) == len(rows):
            log.warning("the catalog names %s of %s/%s whose manifests are not in %s: leaving "
                        "them as they are (`ciuic reindex` rebuilds the catalog from the store "
                        "it indexes)", counted(len(foreign), "snapshot"), project, job,
                        self.name)
        for row in rows:
            if row.status == "committed" and row.id in listed and row.body not in bodies and (
                    not (partial and self.store.has(layout.body_key(project, job, row.body)))):
                self.catalog.set_status(row.id, "pruned")
        found: dict[str, mf.Manifest] = {}
        for sid, got in read.items():
            if isinstance(got, mf.Manifest):
                found[sid] = got
            elif isinstance(got, UnreadableObject) and damaged is not None:
                damaged.append(got)
        self._add_rows(found, lambda sid: self.store)
        return len(found)

    def _try_manifest(self, project: str, job: str, sid: str
                      ) -> mf.Manifest | UnreadableObject | None:
        """A manifest, read and verified; the error where it cannot be read; None where it was
        deleted since it was listed."""
        try:
            return self.read_manifest(project, job, sid)
        except UnreadableObject as e:
            return e
        except ObjectNotFound:
            return None

    def reindex(self, progress: Callable[[str], None] | None = None) -> dict[str, int]:
        """Rebuild the catalog's snapshot rows from the store alone (and from the store of
        every project a server keeps in it)."""
        counts = {"snapshots": 0, "pruned": 0, "damaged": 0, "removed": 0}
        found: dict[str, mf.Manifest] = {}
        where: dict[str, Repository] = {}
        for repo in self.namespaces():
            for mk in list_manifests(repo.store):
                if self.scope(mk.project) is not repo:
                    continue  # a root job hidden by the project a server keeps
                if progress:
                    progress(mk.key)
                try:
                    found[mk.snapshot_id] = repo.read_manifest(mk.project, mk.job,
                                                               mk.snapshot_id)
                    where[mk.snapshot_id] = repo
                except (UnreadableObject, ObjectNotFound):
                    counts["damaged"] += 1
        for status in self._add_rows(found, lambda sid: where[sid].store):
            counts["pruned" if status == "pruned" else "snapshots"] += 1
        for stale in self.catalog.all_snapshot_ids() - set(found):
            self.catalog.remove_snapshot(stale)
            counts["removed"] += 1
        return counts

    def _add_rows(self, found: dict[str, mf.Manifest], store_of: Callable[[str], Store]
                  ) -> list[str]:
        """Add (or update) the catalog's row of each manifest of ``found`` (by its snapshot ID),
        parents first (:func:`commit_order`): "committed" where its body is in ``store_of(ID)``,
        else "pruned". Returns the statuses, in that order."""
        statuses = []
        for sid in commit_order(found):
            m = found[sid]
            status = ("committed" if store_of(sid).has(layout.body_key(m.project, m.job, m.body))
                      else "pruned")
            self.catalog.add_snapshot(m, sid, status)
            statuses.append(status)
        return statuses

    # -- references --------------------------------------------------------------------------

    def split_job(self, text: str) -> tuple[str, str]:
        """``project/job`` -> (project, job); a bare ``job`` must be unique across projects."""
        if "/" in text:
            project, job = text.split("/", 1)
            project, job = layout.check_name("project", project), layout.check_name("job", job)
            named = self.catalog.find_jobs(job)
            if (project, job) not in named and not any(self.manifest_ids(project, job)):
                hint = (" (jobs of that name: " + ", ".join(f"{p}/{j}" for p, j in named) + ")"
                        if named else "")
                raise SnapshotNotFound(f"no job {project}/{job} in this store{hint}; "
                                       "`ciuic ls` lists the jobs")
            return project, job
        matches = self.catalog.find_jobs(text)
        if not matches:
            raise SnapshotNotFound(f"no job named {text!r}; `ciuic ls` lists the jobs")
        if len(matches) > 1:
            names = ", ".join(f"{p}/{j}" for p, j in matches)
            raise SnapshotNotFound(f"job name {text!r} is in several projects ({names}); "
                                   "write PROJECT/JOB")
        return matches[0]

    def healthy(self, project: str, job: str) -> list[SnapshotInfo]:
        """A job's committed snapshots judged healthy, newest first (by commit order).

        Raises :class:`SnapshotNotFound`, saying why, when the job has snapshots but none is
        known to be healthy."""
        every = self.catalog.snapshots(project, job, newest_first=True)
        found = [s for s in every if s.healthy]
        if every and not found:
            sick = [s for s in every if s.healthy is False]
            why = (f"the newest unhealthy one, step {sick[0].step}: "
                   + "; ".join(sick[0].health.reasons if sick[0].health else ()) if sick else "")
            raise SnapshotNotFound(
                f"job {project}/{job} has no snapshot known to be healthy: {len(sick)} of its "
                f"{len(every)} snapshots are unhealthy, {len(every) - len(sick)} were not "
                f"judged (written before ciuic recorded health, or with health=False)"
                f"{' (' + why + ')' if why else ''}. Name a "
                f"snapshot by step or ID instead (`ciuic log {project}/{job}`)")
        return found

    def resolve(self, ref: str) -> SnapshotInfo:
        """Resolve a full ID, a unique ID prefix, ``JOB@STEP``, ``JOB@latest`` or
        ``JOB@healthy`` (the newest snapshot judged healthy)."""
        ref = ref.strip()
        if "@" in ref:
            job_text, _, at = ref.rpartition("@")
            if not job_text:
                raise SnapshotNotFound(f"{ref!r} names no job: write JOB{ref} (or "
                                       f"PROJECT/JOB{ref}); `ciuic ls` lists the jobs")
            project, job = self.split_job(job_text)
            self.sync_job(project, job)
            if at in ("latest", "healthy"):
                found = (self.healthy(project, job) if at == "healthy"
                         else self.catalog.snapshots(project, job, newest_first=True))
                if not found:
                    raise SnapshotNotFound(f"job {project}/{job} has no snapshot")
                return found[0]
            try:
                step = int(at)
            except ValueError:
                raise SnapshotNotFound(
                    f"bad reference {ref!r}: after '@' put a step number, 'latest' or 'healthy'"
                ) from None
            return self.catalog.by_step(project, job, step)
        if is_digest(ref):
            return self.catalog.get(ref)
        if re.fullmatch(r"[0-9a-f]{4,63}", ref):
            return self.catalog.find_prefix(ref)
        raise SnapshotNotFound(
            f"{ref!r} is neither a job of this store nor a snapshot reference: use a snapshot "
            "ID, a unique ID prefix (4+ hex characters), JOB@STEP, JOB@latest or JOB@healthy; "
            "`ciuic ls` lists the jobs"
        )


_MEMORY_CATALOGS: dict[str, Catalog] = {}


def _tiers(store: Store, mirror: str | Store | None, durability: str) -> Store:
    """``store`` with retries, mirrored to ``mirror`` (with retries too) when one is given."""
    fast = store if isinstance(store, RetryingStore) else RetryingStore(store)
    if mirror is None:
        return fast
    remote = open_store(mirror) if isinstance(mirror, str) else mirror
    if not isinstance(remote, RetryingStore):
        remote = RetryingStore(remote)
    return MirrorStore(fast, remote, durability)


def commit_order(manifests: dict[str, mf.Manifest]) -> list[str]:
    """IDs ordered as they were most plausibly committed: by time, but parents always first."""
    ordered: list[str] = []
    done: set[str] = set()

    def visit(sid: str) -> None:
        if sid in done:
            return
        done.add(sid)
        parent = manifests[sid].parent
        if parent in manifests:
            visit(parent)
        ordered.append(sid)

    for sid in sorted(manifests, key=lambda i: (manifests[i].created, manifests[i].step)):
        visit(sid)
    return ordered

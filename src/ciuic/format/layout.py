"""The store's key layout: every key ciuic writes is built here, and every key it reads back is
parsed here, so that nothing else splits key strings (as restic's ``layout`` package does for
its repository).

::

    chunks/<d[:2]>/<d>                              a chunk (content-addressed: d is its digest)
    jobs/<project>/<job>/manifests/<id>.json        a snapshot's manifest (its ID is its digest)
    jobs/<project>/<job>/bodies/<digest>.json       a snapshot's body (content-addressed)
    jobs/<project>/<job>/leases/<token:012d>.json   a run's lease (fencing token; 12 digits or
                                                    more, compared as numbers)
    jobs/<project>/<job>/commit                     the job's commit lock (a lock name)
    locks/gc.json, locks/gc-epoch.json              the gc lock and the gc epoch
    inflight/<name>                                 a save in progress (gc leaves its chunks)
    keys/passphrase-salt                            the salt of a passphrase-derived key
    probes/<run>.json                               a multi-rank job's shared-store probe
    projects/<project>/...                          a server's store: one store per project

Project and job names are checked here (:func:`check_name`): they become parts of keys.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ciuic.errors import ConfigurationError, InvalidKey
from ciuic.format.digest import is_digest

CHUNKS = "chunks/"
#: packs: many small pieces (each a chunk, framed or sealed as one) in one object (format.md)
PACKS = "packs/"
JOBS = "jobs/"
INFLIGHT = "inflight/"
GC_LOCK = "locks/gc.json"
GC_EPOCH = "locks/gc-epoch.json"
PASSPHRASE_SALT = "keys/passphrase-salt"
PROJECTS = "projects/"
#: damaged objects moved aside by ``ciuic gc --quarantine``, each under its old key
QUARANTINE = "quarantine/"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_HEX = r"[0-9a-f]{64}"
_MANIFEST = re.compile(rf"^jobs/({_PART})/({_PART})/manifests/({_HEX})\.json$")
_BODY = re.compile(rf"^jobs/({_PART})/({_PART})/bodies/({_HEX})\.json$")
_CHUNK = re.compile(rf"^chunks/[0-9a-f]{{2}}/({_HEX})$")
_PACK = re.compile(rf"^packs/[0-9a-f]{{2}}/({_HEX})$")
# 12 digits, zero-padded; a token past 10**12 has more (never a leading zero then)
_TOKEN = r"(?:\d{12}|[1-9]\d{12,17})"
_LEASE = re.compile(rf"/leases/({_TOKEN})\.json$")
_LEASE_KEY = re.compile(rf"^jobs/({_PART})/({_PART})/leases/({_TOKEN})\.json$")
_INFLIGHT = re.compile(rf"^inflight/{_PART}$")
_PROBE = re.compile(rf"^probes/{_PART}\.json$")


def is_name(name: str) -> bool:
    """Whether ``name`` is a valid project or job name (:func:`check_name`)."""
    return isinstance(name, str) and bool(_NAME.match(name))


def check_name(what: str, name: str) -> str:
    """Validate a project or job name (it becomes part of store keys)."""
    if not is_name(name):
        raise ConfigurationError(
            f"invalid {what} name {name!r}: use 1-128 characters from letters, digits, "
            "'.', '_' and '-', starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class ManifestKey:
    """A parsed manifest key: whose snapshot it is and its ID."""

    project: str
    job: str
    snapshot_id: str

    @property
    def key(self) -> str:
        return manifest_key(self.project, self.job, self.snapshot_id)


# -- building ----------------------------------------------------------------------------------

def chunk_prefixes() -> list[str]:
    """The prefixes under which chunks are stored: one for each first byte of a digest."""
    return [f"{CHUNKS}{i:02x}/" for i in range(256)]


def chunk_key(d: str) -> str:
    """The store key of the chunk whose digest is ``d``."""
    if not is_digest(d):
        raise InvalidKey(f"invalid chunk digest {d!r}: expected 64 lowercase hex characters")
    return f"{CHUNKS}{d[:2]}/{d}"


def pack_key(name: str) -> str:
    """The store key of the pack named ``name`` (64 lowercase hex characters, random)."""
    if not is_digest(name):
        raise InvalidKey(f"invalid pack name {name!r}: expected 64 lowercase hex characters")
    return f"{PACKS}{name[:2]}/{name}"


def pack_name(key: str) -> str | None:
    """The name a pack key holds, or None for any other key."""
    m = _PACK.match(key)
    return m[1] if m is not None and key[len(PACKS):len(PACKS) + 2] == m[1][:2] else None


def jobs_prefix(project: str | None = None) -> str:
    """The prefix of every job's keys, or of one project's jobs."""
    return JOBS if project is None else f"{JOBS}{check_name('project', project)}/"


def job_prefix(project: str, job: str) -> str:
    return f"{jobs_prefix(project)}{check_name('job', job)}/"


def manifests_prefix(project: str, job: str) -> str:
    return f"{job_prefix(project, job)}manifests/"


def manifest_key(project: str, job: str, snapshot_id: str) -> str:
    return f"{manifests_prefix(project, job)}{snapshot_id}.json"


def body_key(project: str, job: str, body_digest: str) -> str:
    return f"{bodies_prefix(project, job)}{body_digest}.json"


def leases_prefix(project: str, job: str) -> str:
    return f"{job_prefix(project, job)}leases/"


def lease_key(project: str, job: str, token: int) -> str:
    return f"{leases_prefix(project, job)}{token:012d}.json"


def commit_lock_name(project: str, job: str) -> str:
    """The name of the job's commit lock (``Store.lock``)."""
    return f"{job_prefix(project, job)}commit"


def quarantine_key(key: str) -> str:
    """Where ``ciuic gc --quarantine`` moves a damaged object (out of every listing gc and the
    readers make)."""
    return f"{QUARANTINE}{key}"


def inflight_key(name: str) -> str:
    return f"{INFLIGHT}{name}"


def probe_key(run_id: str) -> str:
    """The object rank 0 writes for every rank to look for (one shared store)."""
    return f"probes/{run_id}.json"


def bodies_prefix(project: str, job: str) -> str:
    return f"{job_prefix(project, job)}bodies/"


def project_prefix(project: str) -> str:
    """Where a server keeps a project's store inside its own."""
    return f"{PROJECTS}{check_name('project', project)}/"


# -- parsing -----------------------------------------------------------------------------------

def parse_manifest(key: str) -> ManifestKey | None:
    """The manifest a key names, or None for any other key."""
    m = _MANIFEST.match(key)
    return ManifestKey(m[1], m[2], m[3]) if m else None


def parse_body(key: str) -> tuple[str, str, str] | None:
    """(project, job, body digest) of a body key, or None for any other key."""
    m = _BODY.match(key)
    return (m[1], m[2], m[3]) if m else None


def chunk_digest(key: str) -> str | None:
    """The digest a chunk key names, or None for any other key."""
    m = _CHUNK.match(key)
    return m[1] if m else None


def digest_of_key(key: str) -> str:
    """The digest a chunk key names (inverse of :func:`chunk_key`); raises for another key."""
    d = chunk_digest(key)
    if d is None:
        raise InvalidKey(f"{key!r} is not a chunk key")
    return d


def lease_token(key: str) -> int:
    """The fencing token of a lease key."""
    m = _LEASE.search(key)
    if m is None:
        raise InvalidKey(f"{key!r} is not a lease key")
    return int(m[1])


def parse_lease(key: str) -> tuple[str, str, int] | None:
    """(project, job, token) of a lease key as :func:`lease_key` writes it, or None."""
    m = _LEASE_KEY.match(key)
    return (m[1], m[2], int(m[3])) if m else None


def newest_lease(keys: Iterable[str]) -> str | None:
    """The lease key with the highest token among ``keys`` (by number: token 10**12 is newer
    than 999999999999, whose key sorts after it), or None when there is none."""
    leases = [k for k in keys if _LEASE.search(k)]
    return max(leases, key=lease_token, default=None)


def kind_of(key: str) -> str | None:
    """Which of the layout's keys ``key`` is: ``chunk``, ``pack``, ``manifest``, ``body``,
    ``lease``, ``inflight``, ``probe``, ``salt`` or ``gc`` (the gc lock and epoch); None for any
    key ciuic never writes (a server refuses those)."""
    if chunk_digest(key) is not None:
        return "chunk" if key[len(CHUNKS):len(CHUNKS) + 2] == key[-64:-62] else None
    if key.startswith(PACKS):
        return "pack" if pack_name(key) is not None else None
    if parse_manifest(key) is not None:
        return "manifest"
    if parse_body(key) is not None:
        return "body"
    if parse_lease(key) is not None:
        return "lease"
    if _INFLIGHT.match(key):
        return "inflight"
    if _PROBE.match(key):
        return "probe"
    if key == PASSPHRASE_SALT:
        return "salt"
    if key in (GC_LOCK, GC_EPOCH):
        return "gc"
    return None


def is_content_addressed(key: str) -> bool:
    """Whether a key names its content (a chunk or a body): writing it twice writes the same
    bytes, so a second writer may skip it."""
    return chunk_digest(key) is not None or parse_body(key) is not None


def name_of(key: str) -> str:
    """The last part of a key, without ``.json`` (a snapshot ID, a digest, a token)."""
    return key.rsplit("/", 1)[-1].removesuffix(".json")

"""Which object a key may write or delete (docs/server.md, "Authorization").

A key is project-wide, so the object API cannot trust a writer with every object of its
project: a security review (issue 43) deleted another job's chunks and bodies and forged a lease
that fenced a job out for good. The server accepts only the keys ciuic's layout defines
(:func:`ciuic.format.layout.kind_of`) and, by kind:

==========  ==================================  ==========================================
kind        write (writer)                      delete
==========  ==================================  ==========================================
chunk,      first copy stays                    never: only the server's gc (``POST .../gc``)
pack
body        first copy stays                    an admin, or the key holding the job's lease
manifest    create only (the commit)            never
lease       create only, the job's next token   never
salt        create only                         never
gc          never: only the server's gc         never
inflight,   yes                                 a writer
probe
==========  ==================================  ==========================================

The server records which key took a lease by adding ``"key": ID`` to the lease's JSON; the
key holding a job's newest lease is that job's lease holder.
"""

from __future__ import annotations

import json

from ciuic.catalog.keys import KeyInfo
from ciuic.errors import ApiError, ObjectNotFound
from ciuic.format import layout
from ciuic.store import Store
from ciuic.store.base import check_key

_LEASE_MAX_BYTES = 64 * 1024
_SHAPES = ("chunks/XX/DIGEST, packs/XX/NAME, jobs/PROJECT/JOB/manifests/ID.json, "
           "jobs/PROJECT/JOB/bodies/"
           "DIGEST.json, jobs/PROJECT/JOB/leases/TOKEN.json, inflight/NAME, probes/RUN.json, "
           "keys/passphrase-salt, locks/gc.json, locks/gc-epoch.json")


def object_kind(project: str, key: str, layout_only: bool) -> str:
    """The kind of object ``key`` names (:func:`layout.kind_of`); a key of another project's
    jobs, or one ciuic never writes, is refused (400). ``layout_only`` False (a test server
    for the Store contract) lets any well-formed key through as ``other``."""
    check_key(key)
    if key.startswith(layout.JOBS) and not key.startswith(layout.jobs_prefix(project)):
        raise ApiError(400, "invalid_name", f"{key}: a project's job objects live under "
                       f"jobs/{project}/")
    kind = layout.kind_of(key)
    if kind is None and layout_only:
        raise ApiError(400, "invalid_key", f"{key}: not a key ciuic writes; a server holds "
                       f"only these: {_SHAPES}")
    return kind or "other"


def check_put(kind: str, create: bool) -> None:
    """Refuse a write that the kind does not allow (403)."""
    if kind == "manifest" and not create:
        raise ApiError(403, "forbidden", "a manifest is committed once, with PUT ...?create="
                       "true, and never replaced (it is the chain)")
    if kind in ("lease", "salt") and not create:
        raise ApiError(403, "forbidden", f"a {kind} is written once, with PUT ...?create=true, "
                       "and never replaced")
    if kind == "gc":
        raise ApiError(403, "forbidden", "only the server's gc writes its lock and epoch: "
                       "run it with POST /v1/projects/PROJECT/gc (`ciuic gc`)")


def lease_holder(store: Store, project: str, job: str) -> tuple[int, str | None]:
    """(the job's newest lease token, 0 if none; the API key id that took it, if known)."""
    newest = layout.newest_lease(store.list(layout.leases_prefix(project, job)))
    if newest is None:
        return 0, None
    try:
        held = json.loads(store.get(newest))
    except (ObjectNotFound, ValueError):
        return layout.lease_token(newest), None
    key = held.get("key") if isinstance(held, dict) else None
    return layout.lease_token(newest), key if isinstance(key, str) else None


def new_lease(store: Store, key: str, body: bytes, info: KeyInfo) -> bytes | None:
    """The bytes to create for a lease ``key``: the client's JSON with ``"key"`` set to the
    API key's id; None when the token is taken already (the client takes the next one: 409).
    A token past the job's next one is refused (403): it would fence the job's writer out and
    make its next lease start beyond it."""
    project, job, token = layout.parse_lease(key) or ("", "", 0)
    newest, _ = lease_holder(store, project, job)
    if token <= newest:
        return None
    if token != newest + 1:
        raise ApiError(403, "forbidden", f"job {project}/{job}'s next lease is "
                       f"{layout.lease_key(project, job, newest + 1)}, not {key}")
    try:
        holder = json.loads(body) if len(body) <= _LEASE_MAX_BYTES else None
    except ValueError:
        holder = None
    if not isinstance(holder, dict):
        raise ApiError(400, "invalid_request", "a lease is a JSON object of at most "
                       f"{_LEASE_MAX_BYTES} bytes (who holds it)")
    return json.dumps({**holder, "key": info.id}).encode()


def delete_refusal(store: Store, kind: str, key: str, info: KeyInfo) -> str | None:
    """Why ``info``'s key may not delete ``key`` (a writer's, at least), or None if it may."""
    if kind == "manifest":
        return ("manifests are kept forever (they are the chain); delete a snapshot with "
                "DELETE /v1/projects/P/snapshots/ID")
    if kind in ("chunk", "pack"):
        return (f"{kind}s are deleted only by the server's gc, which keeps every {kind} a "
                "snapshot references: POST /v1/projects/P/gc (`ciuic gc`)")
    if kind in ("lease", "salt", "gc"):
        return f"a {kind} object is never deleted through the API"
    if kind == "body" and not info.allows("admin"):
        project, job, _ = layout.parse_body(key) or ("", "", "")
        _, holder = lease_holder(store, project, job)
        if holder != info.id:
            return (f"only an admin key, or the key holding job {project}/{job}'s lease (its "
                    "running writer's retention), deletes its snapshots' bodies")
    return None

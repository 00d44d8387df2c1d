"""API keys and the audit log, kept in the catalog (docs/server.md, "Keys and roles").

A key reads ``ciuic_<id>_<secret>``: ``id`` (12 hex characters) is public and names the key in
listings and the audit log; the whole key is shown once, at creation, and only its SHA-256 is
stored (a key holds 160 random bits, so a fast hash is enough: there is nothing to brute-force).
Each key belongs to one project with one role: ``reader`` (list and read), ``writer`` (also save
and delete the objects of its snapshots), ``admin`` (also delete snapshots).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from ciuic.catalog.index import Catalog
from ciuic.catalog.models import ApiKey, AuditEvent
from ciuic.errors import ConfigurationError
from ciuic.format.layout import check_name
from ciuic.format.manifest import parse_time, utc_now

ROLES = ("reader", "writer", "admin")
_KEY = re.compile(r"^ciuic_([0-9a-f]{12})_([A-Za-z0-9_-]{20,64})$")


@dataclass(frozen=True)
class KeyInfo:
    id: str
    project: str
    role: str
    name: str
    created: str
    expires: str | None
    revoked: str | None
    last_used: str | None

    def allows(self, role: str) -> bool:
        """Whether this key's role includes ``role``."""
        return ROLES.index(self.role) >= ROLES.index(role)


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(row.id, row.project, row.role, row.name, row.created, row.expires,
                   row.revoked, row.last_used)


def create_key(catalog: Catalog, project: str, role: str, name: str = "",
               expires_days: float | None = None, actor: str = "cli") -> tuple[str, KeyInfo]:
    """A new key for ``project`` (created in the catalog if new): (the key, shown once; info)."""
    check_name("project", project)
    if role not in ROLES:
        raise ConfigurationError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if expires_days is not None and expires_days <= 0:
        raise ConfigurationError(f"expiry must be a positive number of days, got {expires_days}")
    key_id = secrets.token_hex(6)
    key = f"ciuic_{key_id}_{secrets.token_urlsafe(20)}"
    expires = None
    if expires_days is not None:
        expires = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=expires_days)
                   ).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    with catalog.session() as s:
        catalog._project_id(s, project)  # the project exists; no job until one writes
        row = ApiKey(id=key_id, secret_hash=_hash(key), project=project, role=role, name=name,
                     created=utc_now(), expires=expires)
        s.add(row)
        s.flush()
        info = _info(row)
    audit(catalog, actor, project, "apikey.create", f"{key_id} ({role})")
    return key, info


def authenticate(catalog: Catalog, key: str) -> KeyInfo | None:
    """The key's info if it is valid (known, not revoked, not expired), else None."""
    m = _KEY.match(key.strip())
    if m is None:
        return None
    with catalog.session() as s:
        row = s.get(ApiKey, m.group(1))
        if row is None or not hmac.compare_digest(row.secret_hash, _hash(key.strip())):
            return None
        if row.revoked is not None:
            return None
        if row.expires is not None and parse_time(row.expires) <= dt.datetime.now(
                dt.timezone.utc):
            return None
        row.last_used = utc_now()
        return _info(row)


def list_keys(catalog: Catalog, project: str | None = None) -> list[KeyInfo]:
    with catalog.session() as s:
        q = select(ApiKey).order_by(ApiKey.project, ApiKey.created)
        if project is not None:
            q = q.where(ApiKey.project == project)
        return [_info(r) for r in s.scalars(q)]


def revoke_key(catalog: Catalog, key_id: str, actor: str = "cli") -> KeyInfo:
    with catalog.session() as s:
        row = s.get(ApiKey, key_id)
        if row is None:
            raise ConfigurationError(f"no API key with id {key_id!r} (`ciuic apikey list` shows "
                                     "them)")
        if row.revoked is None:
            row.revoked = utc_now()
        info = _info(row)
    audit(catalog, actor, info.project, "apikey.revoke", key_id)
    return info


def audit(catalog: Catalog, actor: str, project: str, action: str, target: str = "",
          remote: str = "") -> None:
    """Append one event to the audit log."""
    with catalog.session() as s:
        s.add(AuditEvent(at=utc_now(), actor=actor, project=project, action=action,
                         target=target, remote=remote))


#: the most events one read of the audit log returns (``limit``); older ones page by ``before``
AUDIT_PAGE = 1000


def audit_time(text: str) -> str:
    """A bound for :func:`audit_log` (``2026-12-05``, ``2026-12-05T11:00``, with seconds, a
    fraction or a zone; UTC unless it says otherwise) as the log writes its times."""
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ConfigurationError(f"{text!r} is not a time: use ISO 8601, e.g. 2026-12-05 or "
                                 "2026-12-05T11:30:00Z") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return utc_now(when.timestamp())


def audit_log(catalog: Catalog, project: str | None = None, limit: int = 100, *,
              key: str | None = None, action: str | None = None, since: str | None = None,
              until: str | None = None, before: int | None = None) -> list[dict[str, Any]]:
    """The newest audit events first, at most ``limit`` (up to :data:`AUDIT_PAGE`): of
    ``project``, by the API key whose id is ``key``, of ``action``, at or after ``since`` and
    before ``until`` (:func:`audit_time`), with an id below ``before`` (the next page: the last
    event's id). Plain comparisons of strings and integers: the same on SQLite and
    PostgreSQL."""
    if not 1 <= limit <= AUDIT_PAGE:
        raise ConfigurationError(f"limit must be between 1 and {AUDIT_PAGE}, got {limit}")
    q = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit)
    if project is not None:
        q = q.where(AuditEvent.project == project)
    if key is not None:
        q = q.where(AuditEvent.actor == f"key:{key}")
    if action is not None:
        q = q.where(AuditEvent.action == action)
    if since is not None:
        q = q.where(AuditEvent.at >= audit_time(since))
    if until is not None:
        q = q.where(AuditEvent.at < audit_time(until))
    if before is not None:
        q = q.where(AuditEvent.id < before)
    with catalog.session() as s:
        return [{"id": e.id, "at": e.at, "actor": e.actor, "project": e.project,
                 "action": e.action, "target": e.target, "remote": e.remote}
                for e in s.scalars(q)]

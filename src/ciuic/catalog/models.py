"""SQLAlchemy models of the catalog: an index of the store (which stays the truth)."""

from __future__ import annotations

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ciuic.version import CATALOG_SCHEMA_VERSION

SCHEMA_VERSION = CATALOG_SCHEMA_VERSION  # the Alembic head is catalog/schema.py's HEAD


class Base(DeclarativeBase):
    pass


class Meta(Base):
    __tablename__ = "ciuic_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Project(Base):
    __tablename__ = "projects"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created: Mapped[str] = mapped_column(String(32))


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("project_id", "name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id"))
    name: Mapped[str] = mapped_column(String(128))
    created: Mapped[str] = mapped_column(String(32))


class Snapshot(Base):
    __tablename__ = "snapshots"
    __table_args__ = (Index("ix_snapshots_job_step", "job_id", "step"),
                      Index("ix_snapshots_job_created", "job_id", "created"))
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    step: Mapped[int] = mapped_column(BigInteger)
    parent: Mapped[str] = mapped_column(String(64))
    created: Mapped[str] = mapped_column(String(32))
    body: Mapped[str] = mapped_column(String(64))
    total_bytes: Mapped[int] = mapped_column(BigInteger)  # 64-bit: states pass 2 GiB
    new_bytes: Mapped[int] = mapped_column(BigInteger)
    tensors: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[str] = mapped_column(Text)  # JSON (not hashed: floats allowed here)
    status: Mapped[str] = mapped_column(String(16))  # committed | pruned
    #: the manifest's health verdict, JSON; NULL for snapshots written before health existed
    health: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: commit order as this catalog saw it (immune to clock steps); "latest" is the highest
    seq: Mapped[int] = mapped_column(Integer, index=True)


class Run(Base):
    """One process's run of a job: how it ended tells the next run what happened."""

    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    started: Mapped[str] = mapped_column(String(32))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    last_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    last_seen: Mapped[str] = mapped_column(String(32))
    ended: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # clean | exit | exit:<status> | exception:<Type> | signal:<NAME> ; NULL while running
    # (or after a kill)
    end_kind: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # why it stopped, as ``ciuic run`` saw it ("hang: no step() for 600 s ..."); NULL otherwise
    cause: Mapped[str | None] = mapped_column(Text, nullable=True)
    # the restart number ``ciuic run`` gave this run (NULL: not started by it, or its first)
    restart: Mapped[int | None] = mapped_column(Integer, nullable=True)


class RunEvent(Base):
    __tablename__ = "run_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(32), index=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    at: Mapped[str] = mapped_column(String(32))
    kind: Mapped[str] = mapped_column(String(32))
    step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    detail: Mapped[str] = mapped_column(Text, default="")


class ApiKey(Base):
    """A server API key: shown once, stored as a hash, bound to one project and one role."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(16), primary_key=True)  # public part of the key
    secret_hash: Mapped[str] = mapped_column(String(64))  # SHA-256 of the whole key, hex
    project: Mapped[str] = mapped_column(String(128), index=True)
    role: Mapped[str] = mapped_column(String(16))  # admin | writer | reader
    name: Mapped[str] = mapped_column(String(128), default="")
    created: Mapped[str] = mapped_column(String(32))
    expires: Mapped[str | None] = mapped_column(String(32), nullable=True)
    revoked: Mapped[str | None] = mapped_column(String(32), nullable=True)
    last_used: Mapped[str | None] = mapped_column(String(32), nullable=True)


class AuditEvent(Base):
    """Who did what: saves, restores, deletions, key management."""

    __tablename__ = "audit_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[str] = mapped_column(String(32), index=True)
    actor: Mapped[str] = mapped_column(String(64))  # "key:<id>" or "cli:<user>@<host>"
    project: Mapped[str] = mapped_column(String(128), index=True)
    action: Mapped[str] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(Text, default="")
    remote: Mapped[str] = mapped_column(String(64), default="")

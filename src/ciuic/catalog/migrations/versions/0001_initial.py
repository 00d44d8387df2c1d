"""The catalog as ciuic 0.1 created it: projects, jobs, snapshots, runs, run events.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("ciuic_meta",
                    sa.Column("key", sa.String(64), primary_key=True),
                    sa.Column("value", sa.Text(), nullable=False))
    op.create_table("projects",
                    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
                    sa.Column("name", sa.String(128), nullable=False, unique=True),
                    sa.Column("created", sa.String(32), nullable=False))
    op.create_table("jobs",
                    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
                    sa.Column("project_id", sa.Integer(), sa.ForeignKey("projects.id"),
                              nullable=False),
                    sa.Column("name", sa.String(128), nullable=False),
                    sa.Column("created", sa.String(32), nullable=False),
                    sa.UniqueConstraint("project_id", "name"))
    op.create_table("snapshots",
                    sa.Column("id", sa.String(64), primary_key=True),
                    sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id"), nullable=False),
                    sa.Column("step", sa.Integer(), nullable=False),
                    sa.Column("parent", sa.String(64), nullable=False),
                    sa.Column("created", sa.String(32), nullable=False),
                    sa.Column("body", sa.String(64), nullable=False),
                    sa.Column("total_bytes", sa.Integer(), nullable=False),
                    sa.Column("new_bytes", sa.Integer(), nullable=False),
                    sa.Column("tensors", sa.Integer(), nullable=False),
                    sa.Column("world_size", sa.Integer(), nullable=False),
                    sa.Column("metrics", sa.Text(), nullable=False),
                    sa.Column("status", sa.String(16), nullable=False),
                    sa.Column("seq", sa.Integer(), nullable=False))
    op.create_index("ix_snapshots_job_step", "snapshots", ["job_id", "step"])
    op.create_index("ix_snapshots_job_created", "snapshots", ["job_id", "created"])
    op.create_index("ix_snapshots_seq", "snapshots", ["seq"])
    op.create_table("runs",
                    sa.Column("id", sa.String(32), primary_key=True),
                    sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id"), nullable=False),
                    sa.Column("started", sa.String(32), nullable=False),
                    sa.Column("host", sa.String(255), nullable=False),
                    sa.Column("pid", sa.Integer(), nullable=False),
                    sa.Column("last_step", sa.Integer(), nullable=True),
                    sa.Column("last_seen", sa.String(32), nullable=False),
                    sa.Column("ended", sa.String(32), nullable=True),
                    sa.Column("end_kind", sa.String(64), nullable=True))
    op.create_index("ix_runs_job_id", "runs", ["job_id"])
    op.create_table("run_events",
                    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
                    sa.Column("run_id", sa.String(32), nullable=False),
                    sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id"), nullable=False),
                    sa.Column("at", sa.String(32), nullable=False),
                    sa.Column("kind", sa.String(32), nullable=False),
                    sa.Column("step", sa.Integer(), nullable=True),
                    sa.Column("detail", sa.Text(), nullable=False))
    op.create_index("ix_run_events_run_id", "run_events", ["run_id"])
    op.create_index("ix_run_events_job_id", "run_events", ["job_id"])


def downgrade() -> None:
    for table in ("run_events", "runs", "snapshots", "jobs", "projects", "ciuic_meta"):
        op.drop_table(table)

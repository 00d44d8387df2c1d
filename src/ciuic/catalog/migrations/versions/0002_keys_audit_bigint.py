"""The server's API keys and audit log; 64-bit steps and byte counts.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_WIDE = [("snapshots", "step", False), ("snapshots", "total_bytes", False),
         ("snapshots", "new_bytes", False), ("runs", "last_step", True),
         ("run_events", "step", True)]


def upgrade() -> None:
    op.create_table("api_keys",
                    sa.Column("id", sa.String(16), primary_key=True),
                    sa.Column("secret_hash", sa.String(64), nullable=False),
                    sa.Column("project", sa.String(128), nullable=False),
                    sa.Column("role", sa.String(16), nullable=False),
                    sa.Column("name", sa.String(128), nullable=False),
                    sa.Column("created", sa.String(32), nullable=False),
                    sa.Column("expires", sa.String(32), nullable=True),
                    sa.Column("revoked", sa.String(32), nullable=True),
                    sa.Column("last_used", sa.String(32), nullable=True))
    op.create_index("ix_api_keys_project", "api_keys", ["project"])
    op.create_table("audit_events",
                    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
                    sa.Column("at", sa.String(32), nullable=False),
                    sa.Column("actor", sa.String(64), nullable=False),
                    sa.Column("project", sa.String(128), nullable=False),
                    sa.Column("action", sa.String(32), nullable=False),
                    sa.Column("target", sa.Text(), nullable=False),
                    sa.Column("remote", sa.String(64), nullable=False))
    op.create_index("ix_audit_events_at", "audit_events", ["at"])
    op.create_index("ix_audit_events_project", "audit_events", ["project"])
    if op.get_bind().dialect.name != "sqlite":  # SQLite's integers are 64-bit already
        for table, column, nullable in _WIDE:
            op.alter_column(table, column, type_=sa.BigInteger(), existing_type=sa.Integer(),
                            existing_nullable=nullable)


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        for table, column, nullable in _WIDE:
            op.alter_column(table, column, type_=sa.Integer(), existing_type=sa.BigInteger(),
                            existing_nullable=nullable)
    op.drop_table("audit_events")
    op.drop_table("api_keys")

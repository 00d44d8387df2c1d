"""Snapshot health: the manifest's verdict, copied into the catalog for ``ciuic log`` and
``JOB@healthy`` (NULL for snapshots written before ciuic judged health).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("snapshots", sa.Column("health", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("snapshots") as batch:  # SQLite: drops by copying the table
        batch.drop_column("health")

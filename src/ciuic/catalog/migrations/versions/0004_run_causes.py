"""Run causes: why a run stopped as ``ciuic run`` saw it (a hang, a signal, the OOM killer, an
exception's last line), and the restart number it gave each run.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("cause", sa.Text(), nullable=True))
    op.add_column("runs", sa.Column("restart", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:  # SQLite: drops by copying the table
        batch.drop_column("restart")
        batch.drop_column("cause")

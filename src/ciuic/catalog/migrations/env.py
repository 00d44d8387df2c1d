"""Alembic environment for the catalog: always run by ciuic itself on a connection it opened
(``ciuic.catalog.schema.migrate``), never from an ``alembic.ini``."""

from __future__ import annotations

from alembic import context

from ciuic.catalog.models import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata,
                  render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()

"""The catalog: a SQL index of the store (SQLite by default), rebuilt from the store on demand.

Nothing here is the source of truth: a snapshot exists when its manifest is in the store. The
catalog makes listing, lookup by step or prefix, and run history fast.

- :mod:`~ciuic.catalog.index`: :class:`Catalog`, the index and its queries;
- :mod:`~ciuic.catalog.models`: its tables (SQLAlchemy);
- :mod:`~ciuic.catalog.schema`: bringing a database to the current schema (Alembic);
- :mod:`~ciuic.catalog.keys`: the server's API keys, kept in the catalog.

May import: ``format`` and the foundation modules.
"""

from ciuic.catalog.index import Catalog

__all__ = ["Catalog"]

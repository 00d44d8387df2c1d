"""The package's version (one place: the root package and the server report it), and the
catalog schema's, which ``ciuic.chain.listing`` reads without importing the catalog
(SQLAlchemy)."""

__version__ = "0.1.0"

#: The catalog's newest migration (``catalog/migrations/versions``): its Alembic head, which
#: ``ciuic.catalog.schema`` brings every catalog to. A test checks that it is Alembic's head.
CATALOG_HEAD = "0004"
#: What the catalog's ``ciuic_meta`` row ``schema_version`` says; a newer one is refused.
CATALOG_SCHEMA_VERSION = 3

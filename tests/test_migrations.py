"""The catalog's Alembic migrations: new catalogs, catalogs from before migrations, the head,
and the models agreeing with the migrations (SQLite and a real PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from ciuic.catalog import Catalog
from ciuic.catalog.models import Base
from ciuic.catalog.schema import HEAD, MIGRATIONS, current
from ciuic.errors import ConfigurationError


def config(conn: object) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = conn
    return cfg


def test_head_is_the_newest_migration() -> None:
    assert ScriptDirectory.from_config(config(None)).get_current_head() == HEAD


def test_a_catalog_from_before_migrations_is_stamped_and_upgraded(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    with engine.begin() as conn:  # what ciuic 0.1's create_all left: the 0001 tables, no stamp
        command.upgrade(config(conn), "0001")
        conn.execute(text("DROP TABLE alembic_version"))
        conn.execute(text("INSERT INTO projects (name, created) VALUES ('p', 'then')"))
    engine.dispose()
    catalog = Catalog(url)
    assert [j for j in catalog.jobs()] == []  # the project is there, with no job yet
    catalog.ensure_job("p", "j")
    catalog.close()
    engine = create_engine(url)
    with engine.connect() as conn:
        assert current(conn) == HEAD
        assert inspect(conn).has_table("api_keys") and inspect(conn).has_table("audit_events")
        assert conn.execute(text("SELECT created FROM projects WHERE name='p'")).scalar() == \
            "then"
    engine.dispose()


def test_a_catalog_from_a_newer_ciuic_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    Catalog(url).close()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0099'"))
    engine.dispose()
    with pytest.raises(ConfigurationError, match="revision 0099, newer than this ciuic"):
        Catalog(url)


def _diff(url: str, compare_type: bool) -> list[object]:
    Catalog(url).close()
    engine = create_engine(url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": compare_type})
        diff = [d for d in compare_metadata(ctx, Base.metadata)
                if not (isinstance(d, tuple) and d and "alembic_version" in str(d))]
    engine.dispose()
    return diff


def test_the_models_match_the_migrations_on_sqlite(tmp_path: Path) -> None:
    assert _diff(f"sqlite:///{tmp_path / 'c.db'}", compare_type=False) == []


def test_the_models_match_the_migrations_on_postgres(pg_url: str) -> None:
    assert _diff(pg_url, compare_type=True) == []

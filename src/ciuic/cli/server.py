"""``ciuic serve`` and ``ciuic apikey``: the server and its keys (registered on the main app)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ciuic.cli.app import Group, app, argument, console, err, store_location

#: the API keys' roles, as ciuic.catalog.keys.ROLES (a test holds them equal): written out here so
#: that the help does not import the catalog (SQLAlchemy)
ROLES = ("reader", "writer", "admin")

if TYPE_CHECKING:
    from ciuic.chain.repo import Repository


def _server_repo() -> Repository:
    """The server's store and catalog (created if new: keys come before the first snapshot)."""
    from ciuic.chain.repo import Repository
    return Repository.open(store_location())


def _actor() -> str:
    import getpass
    import socket

    return f"cli:{getpass.getuser()}@{socket.gethostname()}"


@app.command("serve")
@click.option("--host", default="127.0.0.1", help="Address to listen on")
@click.option("--port", type=int, default=8470, metavar="N", help="Port to listen on")
@click.option("--catalog", help="Catalog database URL (default: the store's SQLite; "
              "postgresql://... for a team)")
@click.option("--certfile", type=click.Path(exists=True, dir_okay=False), metavar="PEM",
              help="Serve HTTPS with this certificate (chain) file; with --keyfile")
@click.option("--keyfile", type=click.Path(exists=True, dir_okay=False), metavar="PEM",
              help="The certificate's private key file")
@click.option("--plain-http", is_flag=True,
              help="Serve plain HTTP on a non-loopback --host: only behind a TLS-terminating "
              "proxy on a network you trust (API keys cross it in cleartext)")
@click.option("--openapi", is_flag=True,
              help="Print the API's OpenAPI document (JSON) and exit, serving nothing")
def serve(host: str, port: int, catalog: str | None, certfile: str | None,
          keyfile: str | None, plain_http: bool, openapi: bool) -> None:
    """Serve the store (--store / CIUIC_HOME) to clients: the API under /v1, its schema at
    /docs and /openapi.json. Stops gracefully on SIGTERM/SIGINT: requests in flight, commits
    included, finish.

    Clients send their API key with every request: on any address but the loopback, serve
    HTTPS (--certfile and --keyfile), or put a TLS proxy in front (docs/server.md)."""
    if openapi:
        _print_openapi()
        return
    if (certfile is None) != (keyfile is None):
        raise click.UsageError("TLS needs both --certfile and --keyfile")
    from ciuic.store.http import is_loopback

    if certfile is None and not is_loopback(host):
        if not plain_http:
            raise click.UsageError(
                f"--host {host} without TLS sends every API key in cleartext over the network. "
                "Give --certfile and --keyfile (HTTPS); or listen on 127.0.0.1 behind a TLS "
                "proxy on this machine; or, with a TLS-terminating proxy on a network you "
                "trust in front, pass --plain-http (docs/server.md, \"TLS\")")
        err.print(f"warning: serving plain HTTP on {host}: API keys cross the network in "
                  "cleartext (--plain-http); a TLS proxy must be in front", style="bold")
    try:
        import uvicorn

        from ciuic.server import create_app
    except ImportError as e:  # pragma: no cover - depends on optional packages
        raise click.BadParameter("the server needs extra packages: pip install "
                                 "'ciuic[server]'") from e
    import logging

    location = store_location()
    scheme = "http" if certfile is None else "https"
    console.print(f"serving {location} on {scheme}://{host}:{port} (API schema: /docs)")
    # one JSON line per request on stderr (ciuic.server.observe), instead of uvicorn's own
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("ciuic.server.access", "ciuic.server"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    uvicorn.run(create_app(location, catalog), host=host, port=port, log_level="info",
                access_log=False, timeout_graceful_shutdown=30, ssl_certfile=certfile,
                ssl_keyfile=keyfile)


def _print_openapi() -> None:
    """``serve --openapi``: the document on standard output, whatever the store (it does not
    depend on one: nothing is opened or created there)."""
    import json
    import tempfile

    try:
        from ciuic.server import create_app
    except ImportError as e:  # pragma: no cover - depends on optional packages
        raise click.BadParameter("the server needs extra packages: pip install "
                                 "'ciuic[server]'") from e
    with tempfile.TemporaryDirectory(prefix="ciuic-openapi-") as tmp:
        server = create_app(tmp)  # over an empty store: the document is the same for any
        try:
            document = server.openapi()
        finally:
            server.state.root.close()
    print(json.dumps(document, indent=2))


@app.group("apikey", cls=Group, no_args_is_help=True)
def apikey_app() -> None:
    """Create, list and revoke the server's API keys."""


@apikey_app.command("create")
@click.option("--project", required=True, help="The key's project (created if new)")
@click.option("--role", required=True, help=f"One of {', '.join(ROLES)}")
@click.option("--name", default="", show_default=False, help="A note: who or what uses it")
@click.option("--expires-days", type=float, metavar="NUMBER",
              help="Expire after this many days (default: never)")
def apikey_create(project: str, role: str, name: str, expires_days: float | None) -> None:
    """Create a key. It is shown once, alone on standard output (KEY=$(ciuic apikey create
    ...) captures it); what it is goes to standard error."""
    from ciuic.catalog.keys import create_key
    repo = _server_repo()
    key, info = create_key(repo.catalog, project, role, name, expires_days, actor=_actor())
    err.print(f"created API key {info.id} for project {info.project} ({info.role})"
              + (f", expires {info.expires[:19]}Z" if info.expires else ""))
    err.print("the key is shown only now; keep it secret:", style="bold")
    print(key)


@apikey_app.command("list")
@click.option("--project", help="Only this project")
def apikey_list(project: str | None) -> None:
    """Every key: id, project, role, state (never the key itself)."""
    from rich import box
    from rich.table import Table

    from ciuic.catalog.keys import list_keys
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)  # as `ciuic ls`
    t.add_column("id", no_wrap=True, min_width=12)  # whole, whatever the width: `revoke` takes it
    for header in ("project", "role", "name", "created", "expires", "state", "last used"):
        # only the note wraps: a time or a name cut short says nothing
        t.add_column(header, no_wrap=header != "name", overflow="fold")
    for k in list_keys(_server_repo().catalog, project):
        state = "revoked" if k.revoked else "active"
        t.add_row(k.id, k.project, k.role, k.name, k.created[:19], (k.expires or "never")[:19],
                  state, (k.last_used or "-")[:19])
    console.print(t)


@apikey_app.command("revoke")
@argument("key_id", help="The key's id (from `list`)")
def apikey_revoke(key_id: str) -> None:
    """Revoke a key: every request with it is refused from now on."""
    from ciuic.catalog.keys import revoke_key
    info = revoke_key(_server_repo().catalog, key_id, actor=_actor())
    console.print(f"revoked API key {info.id} of project {info.project}")


@app.command("audit")
@click.option("--project", help="Only this project (with a server URL: the URL's)")
@click.option("--key", "key_id", metavar="ID", help="Only what this API key did (its id)")
@click.option("--action", help="Only this action, e.g. snapshot.save, snapshot.prune, "
              "object.delete.refused, lease.take, apikey.create")
@click.option("--since", metavar="TIME", help="From this time on (ISO 8601, UTC unless said)")
@click.option("--until", metavar="TIME", help="Before this time")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True,
              help="At most this many events, newest first")
@click.option("--before", type=click.IntRange(min=1), metavar="ID",
              help="Events older than this one (the next page: the id the last page ended at)")
def audit(project: str | None, key_id: str | None, action: str | None, since: str | None,
          until: str | None, limit: int, before: int | None) -> None:
    """Read the server's audit log, newest first: who saved, read, pruned and deleted what.

    On the server's machine (--store: its storage) it reads the catalog, every project's
    events; with --store https://HOST/v1/projects/P it asks the server for that project's (an
    admin key: CIUIC_API_KEY)."""
    from rich import box
    from rich.table import Table

    location = store_location()
    filters: dict[str, Any] = {"key": key_id, "action": action, "since": since, "until": until,
               "limit": limit, "before": before}
    if location.startswith(("http://", "https://")):
        from ciuic.store.http import HttpStore
        server = HttpStore(location)
        try:
            if project not in (None, server.project):
                raise click.BadParameter(f"the server URL names project {server.project}",
                                         param_hint="--project")
            page = server.audit(**filters)
        finally:
            server.close()
        events, more = page["events"], page["next"]
    else:
        from ciuic.catalog.keys import audit_log
        events = audit_log(_server_repo().catalog, project, **filters)
        more = events[-1]["id"] if len(events) == limit else None
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)  # as `apikey list`
    for header in ("id", "at", "actor", "project", "action", "target", "client"):
        t.add_column(header, no_wrap=header not in ("target", "actor"), overflow="fold")
    for e in events:
        t.add_row(str(e["id"]), e["at"][:19] + "Z", e["actor"], e["project"], e["action"],
                  e["target"], e["remote"])
    console.print(t)
    if more is not None:
        err.print(f"older events: add --before {more}")

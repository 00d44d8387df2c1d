"""The ``ciuic`` command line (Click + Rich).

Owns the commands people type; imports any package below it. ``app`` holds the Click
application and what every command shares; ``commands`` the store's commands (ls, log, show,
verify, restore, keygen, demo); ``copying`` push, pull, copy; ``upkeep`` those that change what
it keeps (prune, gc, reindex); ``inspect`` the ones that look inside snapshots (diff);
``server`` the server's (serve, apikey, audit). Nothing imports this package but
``ciuic.__main__`` and the console script.

May import: everything below it (the server and the demo included). The commands import torch
only where they need it.
"""

from __future__ import annotations

import sys

from ciuic.errors import CiuicError


def main() -> None:
    """The console script: every command registered, errors printed as one line (exit 2)."""
    from ciuic.cli import (  # noqa: F401 - registering the commands
        commands,
        copying,
        inspect,
        run,
        server,
        upkeep,
    )
    from ciuic.cli.app import app, err

    try:
        app()
    except CiuicError as e:
        err.print(f"[red]error:[/red] {e}", highlight=False)
        sys.exit(2)
    except OSError as e:  # the environment's (a store or cache this user may not read)
        err.print(f"[red]error:[/red] {os_error_text(e)}", highlight=False)
        sys.exit(2)


def os_error_text(e: OSError) -> str:
    """What an operating-system error at the command line means, and what to do."""
    where = f" {e.filename}" if e.filename is not None else ""
    what = e.strerror or str(e)
    if isinstance(e, PermissionError):
        return (f"cannot access{where}: {what.lower()}; check that this user may read it (and "
                "write it, for a command that changes the store), or point --store / "
                "CIUIC_HOME (or XDG_CACHE_HOME, for a read-only store's catalog) elsewhere")
    return f"cannot access{where}: {what}"


__all__ = ["main"]

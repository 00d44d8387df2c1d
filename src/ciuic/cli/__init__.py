"""The ``ciuic`` command line (Click + Rich).

Owns the commands people type; imports any package below it. ``app`` holds the Click
application and what every command shares; ``commands`` the store's commands (ls, log, show,
verify, restore, prune, gc, reindex, push, pull, copy, keygen, demo); ``inspect`` the ones that
look inside snapshots (diff); ``server`` the server's
(serve, apikey). Nothing imports this package but ``ciuic.__main__`` and the console script.

May import: everything below it (the server and the demo included). The commands import torch
only where they need it.
"""

from __future__ import annotations

import sys

from ciuic.errors import CiuicError


def main() -> None:
    """The console script: every command registered, errors printed as one line (exit 2)."""
    from ciuic.cli import commands, inspect, run, server  # noqa: F401 - registering the commands
    from ciuic.cli.app import app, err

    try:
        app()
    except CiuicError as e:
        err.print(f"[red]error:[/red] {e}", highlight=False)
        sys.exit(2)


__all__ = ["main"]

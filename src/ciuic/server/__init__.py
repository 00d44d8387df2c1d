"""The ciuic server (``ciuic serve``): FastAPI over any ciuic store. Needs ``ciuic[server]``.

May import: ``chain``, ``restore``, ``catalog``, ``format``, ``store`` and the foundation
modules; never the manager.
"""

from ciuic.server.app import create_app

__all__ = ["create_app"]

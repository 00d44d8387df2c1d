"""The ciuic server (``ciuic serve``): FastAPI over any ciuic store. Needs ``ciuic[server]``."""

from .app import create_app

__all__ = ["create_app"]

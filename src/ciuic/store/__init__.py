"""Object stores, chosen by URL scheme.

==================  ==========================================================
``/path``, ``file:///path``   :class:`LocalStore` (the embedded default)
``memory://NAME``             :class:`MemoryStore` (tests, throw-away runs)
``s3://BUCKET/PREFIX``        :class:`~ciuic.store.s3.S3Store` (AWS S3, MinIO, Ceph; boto3)
``https://HOST/v1/projects/P`` :class:`~ciuic.store.http.HttpStore` (a ``ciuic serve`` server)
==================  ==========================================================

Backends register in ``_REGISTRY`` with a lazy import, so optional dependencies are only imported
when their scheme is used, and a missing one produces an install hint.

May import: the foundation modules only (``errors``, ``knobs``, ``threads``). Stores
never interpret keys beyond their syntax; what keys mean is :mod:`ciuic.format.layout`'s.
"""

from __future__ import annotations

import importlib
import os
from urllib.parse import urlparse

from ciuic.errors import ConfigurationError
from ciuic.store.base import Store, check_key
from ciuic.store.local import LocalStore
from ciuic.store.memory import MemoryStore

# scheme -> (module, class, pip extra that provides its dependencies or None)
_REGISTRY: dict[str, tuple[str, str, str | None]] = {
    "file": ("ciuic.store.local", "LocalStore", None),
    "memory": ("ciuic.store.memory", "MemoryStore", None),
    "s3": ("ciuic.store.s3", "S3Store", "s3"),
    "http": ("ciuic.store.http", "HttpStore", "client"),
    "https": ("ciuic.store.http", "HttpStore", "client"),
}


def open_store(url: str | os.PathLike[str]) -> Store:
    """Open the store at ``url``: a local path, ``file://``, or ``memory://NAME``."""
    text = os.fspath(url)
    parsed = urlparse(text)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        path = parsed.path if scheme == "file" else text
        return LocalStore(path)
    if scheme == "memory":
        return MemoryStore.named(parsed.netloc + parsed.path)
    if scheme not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigurationError(
            f"unknown store URL scheme {scheme!r} in {text!r}; this version supports: {known} "
            "(or a plain directory path)"
        )
    module, cls, extra = _REGISTRY[scheme]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - depends on optional packages
        hint = f"pip install 'ciuic[{extra}]'" if extra else "reinstall ciuic"
        raise ConfigurationError(f"the {scheme}:// store needs extra packages: {hint}") from e
    store: Store = getattr(mod, cls)(text)
    return store


__all__ = ["LocalStore", "MemoryStore", "Store", "check_key", "open_store"]

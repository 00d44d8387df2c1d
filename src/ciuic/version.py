"""The package's version (one place: the root package and the server report it)."""

__version__ = "0.1.0"

"""Where a chunk's stored bytes are in a local store, for tests that damage them: its own
object, or its place inside a pack (chain/packs.py)."""

from __future__ import annotations

from pathlib import Path

from ciuic.format import layout
from ciuic.format.descriptor import ChunkRef
from ciuic.store import Store


def stored_at(store: Path | str, ref: ChunkRef) -> tuple[Path, int, int]:
    """(file, first byte, length) of ``ref``'s stored bytes (framed or sealed) in the local
    store at ``store`` (the directory that holds ``objects/``)."""
    objects = Path(store) / "objects"
    if ref.pack is None:
        path = objects / layout.chunk_key(ref.digest)
        return path, 0, path.stat().st_size
    return objects / layout.pack_key(ref.pack), ref.offset, ref.stored


def flip(store: Path | str, ref: ChunkRef, at: int, mask: int = 0x04) -> None:
    """Flip bits of the byte ``at`` bytes into ``ref``'s stored bytes."""
    path, first, n = stored_at(store, ref)
    assert 0 <= at < n, (at, n)
    data = bytearray(path.read_bytes())
    data[first + at] ^= mask
    path.write_bytes(bytes(data))


def truncate(store: Path | str, ref: ChunkRef, keep: int) -> None:
    """Cut ``ref``'s stored bytes to their first ``keep``: a chunk object is truncated; a piece
    in a pack loses its tail (the bytes after it move up, as a short write would leave them)."""
    path, first, n = stored_at(store, ref)
    data = path.read_bytes()
    path.write_bytes(data[:first + keep] + data[first + n:])


def stored_form(store: Store, ref: ChunkRef) -> bytes:
    """``ref``'s stored bytes (framed or sealed), read through ``store``."""
    if ref.pack is None:
        return store.get(layout.chunk_key(ref.digest))
    buf = bytearray(ref.stored)
    store.get_into(layout.pack_key(ref.pack), [memoryview(buf)], ref.offset)
    return bytes(buf)

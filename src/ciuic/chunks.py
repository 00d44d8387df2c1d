"""Chunk objects: how tensor bytes are cut, named and framed (docs/format.md, "Chunks").

A tensor's bytes are cut into pieces of ``knobs.chunk_bytes`` (the last one shorter). Each piece is
stored once, under ``chunks/<d[:2]>/<d>`` where ``d`` is the BLAKE3-256 digest of the plaintext
piece. The object is a 16-byte frame header followed by the payload::

    offset  size  field
    0       4     magic b"CIUK"
    4       1     frame version (1)
    5       1     codec  (0 = raw; others reserved for compression)
    6       1     cipher (0 = none; others reserved for encryption)
    7       1     reserved, 0
    8       8     plaintext length, unsigned little-endian
    16      ...   payload

A reader checks the header, decodes the payload and re-hashes the plaintext: a chunk whose bytes
do not hash to its name is damaged, and is never loaded.
"""

from __future__ import annotations

import struct

from .digest import Buffer, digest, is_digest
from .errors import CorruptObject, InvalidKey

MAGIC = b"CIUK"
FRAME_VERSION = 1
CODEC_RAW = 0
CIPHER_NONE = 0
_HEADER = struct.Struct("<4sBBBBQ")
HEADER_BYTES = _HEADER.size  # 16


def chunk_key(d: str) -> str:
    """The store key of the chunk whose digest is ``d``."""
    if not is_digest(d):
        raise InvalidKey(f"invalid chunk digest {d!r}: expected 64 lowercase hex characters")
    return f"chunks/{d[:2]}/{d}"


def digest_of_key(key: str) -> str:
    """The digest a chunk key names (inverse of :func:`chunk_key`)."""
    d = key.rsplit("/", 1)[-1]
    if not key.startswith("chunks/") or not is_digest(d):
        raise InvalidKey(f"{key!r} is not a chunk key")
    return d


def split(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each piece of a ``nbytes`` buffer; one empty piece for 0 bytes."""
    if nbytes == 0:
        return [(0, 0)]
    return [(off, min(chunk_bytes, nbytes - off)) for off in range(0, nbytes, chunk_bytes)]


def header(length: int, cipher: int = CIPHER_NONE) -> bytes:
    return _HEADER.pack(MAGIC, FRAME_VERSION, CODEC_RAW, cipher, 0, length)


def frame(plain: Buffer) -> list[Buffer]:  # a store.Data list
    """The stored form of a plaintext piece, as buffers to write back to back (no copy)."""
    return [header(len(plain)), plain]


def is_framed(blob: bytes | bytearray | memoryview) -> bool:
    return bytes(blob[:4]) == MAGIC


def is_sealed(header_bytes: bytes | bytearray | memoryview) -> bool:
    return len(header_bytes) >= HEADER_BYTES and header_bytes[6] != CIPHER_NONE


def check_header(key: str, header_bytes: bytes | bytearray, size: int, *, sealed: bool) -> int:
    """Check a frame header; returns the plaintext length it states."""
    if size < HEADER_BYTES:
        raise CorruptObject(key, f"truncated: {size} bytes, shorter than the header")
    magic, version, codec, cipher, reserved, length = _HEADER.unpack_from(header_bytes)
    if magic != MAGIC:
        raise CorruptObject(key, "not a ciuic object (bad magic)")
    if reserved != 0:
        raise CorruptObject(key, "reserved header byte is not zero")
    if version != FRAME_VERSION:
        raise CorruptObject(key, f"unknown frame version {version} (newer ciuic? upgrade)")
    if codec != CODEC_RAW or cipher not in ((1,) if sealed else (CIPHER_NONE,)):
        raise CorruptObject(key, f"unsupported codec {codec} / cipher {cipher}")
    return int(length)


def unframe(key: str, blob: bytes, expected_digest: str, expected_len: int) -> memoryview:
    """Check and decode a stored chunk; returns the plaintext. Raises :class:`CorruptObject`."""
    payload = memoryview(blob)[HEADER_BYTES:]
    check_read(key, blob[:HEADER_BYTES], len(blob), payload, expected_digest, expected_len)
    return payload


def check_read(key: str, header: bytes | bytearray, size: int, payload: memoryview,
               expected_digest: str, expected_len: int) -> None:
    """Check a chunk read straight into its destination: ``header`` (16 bytes), the object's
    total ``size``, and the ``payload`` view it filled. Raises :class:`CorruptObject`."""
    length = check_header(key, header, size, sealed=False)
    if length != expected_len or size - HEADER_BYTES != expected_len:
        raise CorruptObject(
            key, f"length mismatch: header says {length}, object holds {size - HEADER_BYTES}, "
            f"manifest expects {expected_len} (truncated?)"
        )
    actual = digest(payload)
    if actual != expected_digest:
        raise CorruptObject(key, f"content hash {actual[:16]}... does not match its name")


def header_length(header: bytes | bytearray) -> int:
    """The plaintext length a chunk's header claims (for checking unreferenced chunks)."""
    return int(_HEADER.unpack_from(header)[5]) if len(header) >= HEADER_BYTES else -1

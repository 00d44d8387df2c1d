"""Chunk objects: how tensor bytes are cut, named and framed (docs/format.md, "Chunks").

A tensor's bytes are cut into pieces of ``knobs.chunk_bytes`` (the last one shorter). Each piece is
stored once, under ``chunks/<d[:2]>/<d>`` where ``d`` is the BLAKE3-256 digest of the plaintext
piece. The object is a 16-byte frame header followed by the payload::

    offset  size  field
    0       4     magic b"CIUK"
    4       1     frame version (1)
    5       1     codec  (0 = raw; 1 = float byte planes, ciuic.floatcodec)
    6       1     cipher (0 = none; others reserved for encryption)
    7       1     reserved, 0
    8       8     plaintext length, unsigned little-endian
    16      ...   payload

The length is always the plaintext's; with codec 1 the payload is the float codec's
self-describing encoding of it (sealed objects encrypt that payload). A reader checks the header,
decodes the payload and re-hashes the plaintext: a chunk whose bytes do not hash to its name is
damaged, and is never loaded.
"""

from __future__ import annotations

import struct

from ciuic.errors import CorruptObject, IntegrityError, UnsupportedFormat
from ciuic.format.digest import Buffer, digest

MAGIC = b"CIUK"
FRAME_VERSION = 1
CODEC_RAW = 0
CODEC_FLOAT = 1
CODECS = (CODEC_RAW, CODEC_FLOAT)
CIPHER_NONE = 0
_HEADER = struct.Struct("<4sBBBBQ")
HEADER_BYTES = _HEADER.size  # 16


def split(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each piece of a ``nbytes`` buffer; one empty piece for 0 bytes."""
    if nbytes == 0:
        return [(0, 0)]
    return [(off, min(chunk_bytes, nbytes - off)) for off in range(0, nbytes, chunk_bytes)]


def header(length: int, cipher: int = CIPHER_NONE, codec: int = CODEC_RAW) -> bytes:
    return _HEADER.pack(MAGIC, FRAME_VERSION, codec, cipher, 0, length)


def frame(plain: Buffer, encoded: bytes | None = None) -> list[Buffer]:  # a store.Data list
    """The stored form of a plaintext piece, as buffers to write back to back (no copy):
    raw, or ``encoded`` (the float codec's payload for ``plain``) when given."""
    if encoded is not None:
        return [header(len(plain), codec=CODEC_FLOAT), encoded]
    return [header(len(plain)), plain]


def codec_of(header_bytes: bytes | bytearray | memoryview) -> int:
    return int(header_bytes[5]) if len(header_bytes) >= HEADER_BYTES else CODEC_RAW


def decode_payload(key: str, codec: int, payload: Buffer, length: int,
                   out: memoryview | None = None) -> memoryview:
    """The plaintext of a payload stored with ``codec`` (written into ``out`` when given)."""
    if codec == CODEC_RAW:
        view = memoryview(payload).cast("B")
        if out is not None:
            out[:len(view)] = view
            return out[:len(view)]
        return view
    from ciuic.format import floatcodec

    try:
        plain = floatcodec.decode(payload, out)
    except UnsupportedFormat as e:
        raise UnsupportedFormat(key, f"{e.key}: {e.reason}") from None
    except IntegrityError as e:
        raise CorruptObject(key, str(e)) from None
    except ValueError as e:  # e.g. an ``out`` that does not fit what the payload claims
        raise CorruptObject(key, f"compressed payload does not fit: {e}") from None
    view = memoryview(plain).cast("B")
    if len(view) != length:
        raise CorruptObject(key, f"decodes to {len(view)} bytes, the header says {length}")
    return view


def is_framed(blob: bytes | bytearray | memoryview) -> bool:
    return bytes(blob[:4]) == MAGIC


def is_sealed(header_bytes: bytes | bytearray | memoryview) -> bool:
    return len(header_bytes) >= HEADER_BYTES and header_bytes[6] != CIPHER_NONE


def check_header(key: str, header_bytes: bytes | bytearray | memoryview, size: int, *,
                 sealed: bool) -> int:
    """Check a frame header; returns the plaintext length it states."""
    if size < HEADER_BYTES:
        raise CorruptObject(key, f"truncated: {size} bytes, shorter than the header")
    magic, version, codec, cipher, reserved, length = _HEADER.unpack_from(header_bytes)
    if magic != MAGIC:
        raise CorruptObject(key, "not a ciuic object (bad magic)")
    if reserved != 0:
        raise CorruptObject(key, "reserved header byte is not zero")
    if version != FRAME_VERSION:
        raise UnsupportedFormat(key, f"unknown frame version {version} (written by a newer "
                                     "ciuic? upgrade to read it)")
    if codec not in CODECS or cipher not in ((1,) if sealed else (CIPHER_NONE,)):
        raise UnsupportedFormat(key, f"unsupported codec {codec} / cipher {cipher} (written by a "
                                     "newer ciuic? upgrade to read it)")
    return int(length)


def unframe(key: str, blob: bytes | memoryview, expected_digest: str,
            expected_len: int) -> memoryview:
    """Check and decode a stored chunk; returns the plaintext. Raises :class:`CorruptObject`."""
    return _checked(key, blob[:HEADER_BYTES], len(blob), memoryview(blob)[HEADER_BYTES:], None,
                    expected_digest, expected_len)


def check_digest(key: str, plain: Buffer, expected_digest: str) -> None:
    actual = digest(plain)
    if actual != expected_digest:
        raise CorruptObject(key, f"content hash {actual[:16]}... does not match its name")


def check_read(key: str, header: bytes | bytearray, size: int, payload: memoryview,
               expected_digest: str, expected_len: int) -> None:
    """Check a chunk read straight into its destination: ``header`` (16 bytes), the object's
    total ``size``, and the ``payload`` view it filled (the plaintext's size). A compressed
    payload landed at the front of it and is decoded in place, from a copy. Raises
    :class:`CorruptObject`."""
    if codec_of(header) == CODEC_RAW:
        _checked(key, header, size, payload, None, expected_digest, expected_len)
    else:
        encoded = bytes(payload[:max(0, size - HEADER_BYTES)])
        _checked(key, header, size, encoded, payload, expected_digest, expected_len)


def _checked(key: str, header: bytes | bytearray | memoryview, size: int, encoded: Buffer,
             out: memoryview | None, expected_digest: str, expected_len: int) -> memoryview:
    """Check the header and lengths, decode ``encoded`` (into ``out`` if given), check the
    plaintext against its name; returns the plaintext."""
    length = check_header(key, header, size, sealed=False)
    codec = codec_of(header)
    stored = size - HEADER_BYTES
    if length != expected_len or (stored != length if codec == CODEC_RAW else stored > length):
        raise CorruptObject(
            key, f"length mismatch: header says {length}, object holds {stored}, "
            f"manifest expects {expected_len} (truncated?)"
        )
    plain = decode_payload(key, codec, encoded, length, out)
    check_digest(key, plain, expected_digest)
    return plain


def header_length(header: bytes | bytearray | memoryview) -> int:
    """The plaintext length a chunk's header claims (for checking unreferenced chunks)."""
    return int(_HEADER.unpack_from(header)[5]) if len(header) >= HEADER_BYTES else -1

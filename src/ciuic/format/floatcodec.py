"""Float-aware lossless compression of one chunk of tensor bytes.

A chunk of little-endian floats is split into byte planes (plane ``k`` holds byte ``k`` of every
value, so the top plane holds the sign and the high exponent bits). Only the planes that
compress are compressed; the others are stored raw. In weights and optimizer moments only the
top plane compresses (its 256 possible bytes are concentrated on a handful of exponents); the
mantissa planes are noise, and trying to compress them costs time for nothing, so a plane other
than the top one is tried only when a small subsample of it compresses.

The top plane goes through a *nibble code* when, as in weights, 8 neighbouring exponents (with
either sign) or 16 (with one sign) hold all but a few of its values: each byte becomes a 4-bit
code, two codes a byte, and the rare other bytes are stored aside as escapes (position, byte).
zstd then Huffman-codes the packed codes: half as many bytes as the plane, and zstd's Huffman
coder, about 1 ns a byte on the development VM, is where the time goes. Otherwise the plane is
given to zstd as it is. The zstd parameters are chosen for this data, not taken from a level:
``min_match`` 7 and a 64-entry hash table make the match finder give up quickly (matches in
exponent bytes are short and pay little), which is both faster and smaller than level 1 here
(docs/benchmarks.md, "Compression study"; bench/compress_study.py measures it).

Payload layout (all integers little-endian)::

    offset  size         field
    0       2            magic b"FZ"
    2       1            payload version (1)
    3       1            float kind (1 f32, 2 bf16, 3 f16, 4 f64)
    4       1            itemsize (4, 2, 2, 8: must match the kind)
    5       1            flags: 0 (reserved; a payload with other flags is refused)
    6       2            reserved, 0
    8       8            raw length (the decoded size in bytes)
    16      5*itemsize   per plane, least significant byte first: method (0 raw, 1 zstd,
                         2 nibble code + zstd), then the stored length, u32
    ...     4            CRC-32 of everything above
    ...                  the planes' stored bytes, back to back, then the tail: the last
                         ``raw length % itemsize`` bytes (a value cut by the chunk boundary), raw

Structural damage (truncation, a flipped header byte, a zstd frame that does not decode to its
plane) raises :class:`ciuic.errors.IntegrityError`. A flipped bit inside a raw plane cannot be
seen here: the chunk's BLAKE3 digest, checked by the reader after decoding, is what proves the
content.

Every function is safe to call from several threads at once: the zstd contexts, which must not be
shared, are per thread.
"""

from __future__ import annotations

import math
import struct
import threading
import time
import zlib
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import zstandard

from ciuic.errors import ConfigurationError, IntegrityError, UnsupportedFormat

__all__ = [
    "FLOAT_KINDS",
    "MAX_RATIO",
    "MAX_RAW_BYTES",
    "SAMPLE_BYTES",
    "ZSTD_PARAMS",
    "decode",
    "encode",
    "measure",
]

Bytes = bytes | bytearray | memoryview
U8 = npt.NDArray[np.uint8]

MAGIC: Final = b"FZ"
VERSION: Final = 1
#: float kind name -> (code in the header, itemsize)
FLOAT_KINDS: Final[dict[str, tuple[int, int]]] = {
    "f32": (1, 4),
    "bf16": (2, 2),
    "f16": (3, 2),
    "f64": (4, 8),
}
_KIND_BY_CODE: Final = {code: (name, size) for name, (code, size) in FLOAT_KINDS.items()}
METHOD_RAW: Final = 0
METHOD_ZSTD: Final = 1
METHOD_NIBBLE: Final = 2
_METHODS: Final = (METHOD_RAW, METHOD_ZSTD, METHOD_NIBBLE)

#: encode returns None (store raw) when the payload is larger than this fraction of the input.
MAX_RATIO: Final = 0.95
#: measure times the encoding of at most this many leading bytes of its sample.
SAMPLE_BYTES: Final = 256 * 1024
#: the largest chunk encode and decode accept (bounds what a damaged header makes decode allocate).
MAX_RAW_BYTES: Final = 1 << 32

_FIXED = struct.Struct("<2sBBBBHQ")
_PLANE = struct.Struct("<BI")
_CRC = struct.Struct("<I")
_WORD: Final[dict[int, np.dtype[Any]]] = {
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}

# A plane other than the top one is compressed only when a subsample of it compresses to less
# than this fraction; a compressed plane is kept only when it is smaller than this fraction too.
_PLANE_MAX_RATIO: Final = 0.9
_PLANE_SAMPLE: Final = 16 * 1024
_MIN_PLANE: Final = 64  # planes shorter than this are stored raw: a zstd frame would not pay
# The nibble code is used only when at most this fraction of the values are escapes (each costs
# 5 bytes: 40 bits, against the 2-4 bits a coded exponent takes).
_NIBBLE_MAX_ESCAPES: Final = 1 / 512
_NIBBLE = struct.Struct("<BBI")  # signed (0/1), base, escape count

#: zstd parameters for the planes (see the module docstring).
ZSTD_PARAMS: Final = zstandard.ZstdCompressionParameters(
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,  # > 0 would turn off Huffman coding of literals with the fast strategy
    strategy=zstandard.STRATEGY_FAST,
    write_content_size=True,
    write_checksum=False,  # the reader re-hashes the plaintext (BLAKE3) anyway
    write_dict_id=False,
)


class _Contexts(threading.local):
    """zstd contexts are not thread-safe: one pair per thread, made on first use."""

    def __init__(self) -> None:
        self.cctx = zstandard.ZstdCompressor(compression_params=ZSTD_PARAMS)
        self.dctx = zstandard.ZstdDecompressor()


_contexts = _Contexts()


def _kind(float_kind: str, itemsize: int) -> int:
    try:
        code, size = FLOAT_KINDS[float_kind]
    except KeyError:
        kinds = ", ".join(FLOAT_KINDS)
        raise ConfigurationError(
            f"unknown float kind {float_kind!r}: expected one of {kinds}"
        ) from None
    if itemsize != size:
        raise ConfigurationError(
            f"itemsize {itemsize} does not fit float kind {float_kind!r} ({size} bytes a value)"
        )
    return code


def _byte_view(data: Bytes, what: str) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ConfigurationError(f"{what} must be a contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _words(arr: U8, itemsize: int, n: int) -> npt.NDArray[np.unsignedinteger[Any]]:
    """The first ``n`` values of ``arr`` as little-endian unsigned integers of ``itemsize``."""
    words: npt.NDArray[np.unsignedinteger[Any]] = arr[: n * itemsize].view(_WORD[itemsize])
    return words


def _plane(words: npt.NDArray[np.unsignedinteger[Any]], k: int) -> U8:
    """Byte ``k`` of every value, contiguous (a cast from the words: faster than a strided copy)."""
    shifted = words >> (8 * k) if k else words
    return shifted.astype(np.uint8)


def _subsample(plane: U8) -> U8:
    step = max(1, plane.size // _PLANE_SAMPLE)
    return np.ascontiguousarray(plane[::step][:_PLANE_SAMPLE])


def _nibble_plan(sample: U8) -> tuple[bool, int, float]:
    """(signed, base, escape fraction) of the best nibble code for a plane, from a sample.

    A byte ``p`` is coded by ``d = (base - p) mod 256``. Signed code (for sign + exponent
    bytes): ``d & 7`` in bits 0-2 and ``d``'s bit 7 (the sign, flipped when the subtraction
    wraps) in bit 3, valid when ``d & 0x78 == 0``, i.e. ``p & 0x7f`` is one of the 8 values at
    and below ``base``. Unsigned code (all values of one sign): ``d`` itself, valid when below
    16. Other bytes are escapes, stored aside; their code is meaningless.
    """
    hist = np.bincount(sample, minlength=256)
    best = (False, 0, 2.0)
    for signed, h in ((True, hist[:128] + hist[128:]), (False, hist)):
        width = 8 if signed else 16
        wrapped = np.concatenate([h[len(h) - width + 1 :], h])
        covered = np.convolve(wrapped, np.ones(width, dtype=np.int64), mode="valid")
        base = int(np.argmax(covered))
        escapes = 1.0 - float(covered[base]) / max(1, sample.size)
        if escapes < best[2]:
            best = (signed, base, escapes)
    return best


def _nonzero_positions(flags: U8) -> npt.NDArray[np.uint32]:
    """Indices of the non-zero bytes of ``flags`` (its length a multiple of 8), when few.

    Scans 8 bytes at a time (as uint64), then only the blocks that hold a non-zero byte: many
    times faster than ``np.flatnonzero`` on the whole array (which has a fast path only for
    booleans).
    """
    blocks = np.flatnonzero(flags.view(np.uint64) != 0)
    if blocks.size == 0:
        return np.empty(0, dtype="<u4")
    inner = np.flatnonzero(flags.reshape(-1, 8)[blocks])
    positions: npt.NDArray[np.uint32] = (blocks[inner >> 3] * 8 + (inner & 7)).astype("<u4")
    return positions


def _nibble_encode(cctx: zstandard.ZstdCompressor, plane: U8, sample: U8) -> list[Bytes] | None:
    """The exponent plane as 4-bit codes packed two a byte, zstd'd (as the pieces to write
    back to back); None when the plane's values are too spread for the code.

    Packing halves the bytes zstd's Huffman coder must go through (its cost is per byte) and
    lets it code pairs of exponents. Layout: signed (u8), base (u8), escape count ``m`` (u32),
    ``m`` escape positions (u32, increasing), their ``m`` original bytes, then the zstd frame of
    the ``ceil(n / 2)`` packed bytes (the first value in the low nibble).
    """
    signed, base, est = _nibble_plan(sample)
    if est > _NIBBLE_MAX_ESCAPES:
        return None
    n = plane.size
    padded = -(-n // 8) * 8
    d = np.empty(padded, dtype=np.uint8)
    d[n:] = 0  # padding: code 0, never an escape
    np.subtract(np.uint8(base), plane, out=d[:n])
    positions = _nonzero_positions(np.bitwise_and(d, 0x78 if signed else 0xF0))
    m = positions.size
    if m > n * _NIBBLE_MAX_ESCAPES:
        return None
    d[positions] = 0  # an escape's code must stay below 16 not to spill into its neighbour's
    if signed:  # d = sign * 128 + low 3 bits -> code = sign * 8 + low 3 bits
        sign = np.right_shift(d, 7)
        np.multiply(sign, 120, out=sign)  # numpy's uint8 << has no SIMD loop; * does
        np.subtract(d, sign, out=d)
    pairs16 = d[: -(-n // 2) * 2].view("<u2")
    packed = np.bitwise_or(pairs16 >> 4, pairs16).astype(np.uint8)
    head = _NIBBLE.pack(int(signed), base, m)
    return [head, positions.data, plane[positions].data, cctx.compress(packed.data)]


def _nibble_decode(dctx: zstandard.ZstdDecompressor, body: memoryview, dest: U8) -> None:
    """Decode a nibble-coded plane into ``dest`` (a strided column of the output, n bytes)."""
    n = dest.size
    if body.nbytes < _NIBBLE.size:
        raise _damaged("truncated nibble-coded plane")
    signed, base, m = _NIBBLE.unpack_from(body)
    if signed not in (0, 1) or m > n:
        raise _damaged("bad nibble-coded plane parameters")
    start = _NIBBLE.size + 5 * m
    if body.nbytes < start:
        raise _damaged("truncated nibble-coded plane")
    positions = np.frombuffer(body, dtype="<u4", count=m, offset=_NIBBLE.size)
    if m and int(positions.max()) >= n:
        raise _damaged("a nibble escape position is out of range")
    values = np.frombuffer(body, dtype=np.uint8, count=m, offset=_NIBBLE.size + 4 * m)
    packed = np.frombuffer(_unzstd(dctx, body[start:], (n + 1) // 2), dtype=np.uint8)
    pairs16 = packed.astype("<u2")  # byte hl -> 0h0l: the two codes, in value order
    spread = np.left_shift(pairs16, 4)
    np.bitwise_or(pairs16, spread, out=pairs16)
    np.bitwise_and(pairs16, 0x0F0F, out=pairs16)
    d = pairs16.view(np.uint8)[:n]
    if signed:  # code = sign * 8 + low 3 bits -> d = sign * 128 + low 3 bits
        sign = np.right_shift(d, 3)
        np.multiply(sign, 120, out=sign)
        np.add(d, sign, out=d)
    np.subtract(np.uint8(base), d, out=dest)
    dest[positions] = values


def _pack_plane(cctx: zstandard.ZstdCompressor, plane: U8, *, top: bool) -> tuple[int, list[Bytes]]:
    """(method, stored bytes as pieces to write back to back) of one byte plane.

    The top plane (sign and high exponent bits) is always tried, with the nibble code when its
    values are concentrated enough, else plain zstd. Another plane is tried only when a
    subsample of it compresses (mantissa planes of weights do not).
    A plane that does not shrink to ``_PLANE_MAX_RATIO`` is stored raw.
    """
    n = plane.size
    raw: tuple[int, list[Bytes]] = (METHOD_RAW, [plane.data])
    if n < _MIN_PLANE:
        return raw
    sample = _subsample(plane)
    method, packed = METHOD_NIBBLE, None
    if top:
        packed = _nibble_encode(cctx, plane, sample)
    elif len(cctx.compress(sample.data)) >= _PLANE_MAX_RATIO * sample.size:
        return raw
    if packed is None:
        method, packed = METHOD_ZSTD, [cctx.compress(plane.data)]
    if sum(memoryview(p).nbytes for p in packed) < _PLANE_MAX_RATIO * n:
        return method, packed
    return raw


def encode(
    data: Bytes,
    itemsize: int,
    *,
    float_kind: str,
    max_ratio: float = MAX_RATIO,
) -> bytes | None:
    """Compress one chunk of raw little-endian float bytes.

    ``itemsize`` and ``float_kind`` ("f32", "bf16", "f16" or "f64") must agree. The chunk may end
    with a partial value (its bytes are stored raw).

    Returns the self-describing payload, or None when it would be larger than ``max_ratio`` times
    the input (store the raw bytes then). ``max_ratio=math.inf`` always returns a payload.
    """
    kind = _kind(float_kind, itemsize)
    raw = _byte_view(data, "data")
    size = raw.nbytes
    if size > MAX_RAW_BYTES:
        raise ConfigurationError(f"a chunk of {size} bytes is over the {MAX_RAW_BYTES}-byte limit")
    if size == 0 and not math.isinf(max_ratio):
        return None
    arr: U8 = np.frombuffer(raw, dtype=np.uint8)
    flags = 0
    n, tail = divmod(size, itemsize)
    words = _words(arr, itemsize, n)
    cctx = _contexts.cctx
    table: list[bytes] = []
    parts: list[Bytes] = []
    stored = 0
    for k in range(itemsize):
        method, pieces = _pack_plane(cctx, _plane(words, k), top=k == itemsize - 1)
        length = sum(memoryview(p).nbytes for p in pieces)
        table.append(_PLANE.pack(method, length))
        parts += pieces
        stored += length
    head = _FIXED.pack(MAGIC, VERSION, kind, itemsize, flags, 0, size) + b"".join(table)
    head += _CRC.pack(zlib.crc32(head))
    if not math.isinf(max_ratio) and len(head) + stored + tail > max_ratio * size:
        return None
    parts.insert(0, head)
    parts.append(arr[n * itemsize :].data)
    return b"".join(parts)


class _Header:
    __slots__ = ("flags", "itemsize", "kind", "planes", "raw_len", "start")

    def __init__(
        self, kind: str, itemsize: int, flags: int, raw_len: int, planes: list[tuple[int, int]]
    ) -> None:
        self.kind = kind
        self.itemsize = itemsize
        self.flags = flags
        self.raw_len = raw_len
        self.planes = planes
        self.start = _FIXED.size + _PLANE.size * itemsize + _CRC.size


def _damaged(reason: str) -> IntegrityError:
    return IntegrityError(f"float-codec payload is damaged: {reason}")


def _parse(buf: memoryview) -> _Header:
    if buf.nbytes < _FIXED.size:
        raise _damaged(f"truncated: {buf.nbytes} bytes, shorter than the header")
    magic, version, code, itemsize, flags, reserved, raw_len = _FIXED.unpack_from(buf)
    if magic != MAGIC:
        raise _damaged("bad magic (not a float-codec payload)")
    if code not in _KIND_BY_CODE:
        raise _damaged(f"unknown float kind code {code}")
    kind, size = _KIND_BY_CODE[code]
    if itemsize != size:
        raise _damaged(f"itemsize {itemsize} does not fit float kind {kind}")
    head_len = _FIXED.size + _PLANE.size * itemsize
    if buf.nbytes < head_len + _CRC.size:
        raise _damaged(f"truncated: {buf.nbytes} bytes, shorter than the header")
    (crc,) = _CRC.unpack_from(buf, head_len)
    if zlib.crc32(buf[:head_len]) != crc:
        raise _damaged("header checksum mismatch" + (
            f" (its version byte says {version}: if a newer ciuic wrote it, upgrade)"
            if version != VERSION else ""))
    # an intact header this ciuic cannot read: a newer format, not damage
    if version != VERSION:
        raise UnsupportedFormat("float-codec payload", f"unknown payload version {version} "
                                f"(this ciuic reads {VERSION}): written by a newer ciuic? "
                                "upgrade to read it")
    if flags or reserved:
        raise UnsupportedFormat("float-codec payload", f"unknown flags {flags:#x} or non-zero "
                                "reserved bytes: written by a newer ciuic? upgrade to read it")
    if raw_len > MAX_RAW_BYTES:
        raise _damaged(f"raw length {raw_len} is over the {MAX_RAW_BYTES}-byte limit")
    n, tail = divmod(raw_len, itemsize)
    planes = [_PLANE.unpack_from(buf, _FIXED.size + _PLANE.size * k) for k in range(itemsize)]
    for method, length in planes:
        if method == METHOD_RAW and length != n:
            raise _damaged(f"a raw plane of {length} bytes where {n} values are expected")
        if method not in _METHODS:
            raise _damaged(f"unknown plane method {method}")
    header = _Header(kind, itemsize, flags, raw_len, planes)
    expected = header.start + sum(length for _, length in planes) + tail
    if buf.nbytes != expected:
        raise _damaged(f"{buf.nbytes} bytes where the header describes {expected}")
    return header


def decode(payload: Bytes, out: memoryview | None = None) -> bytes | memoryview:
    """Exact inverse of :func:`encode`.

    With ``out`` (a writable buffer at least as long as the decoded chunk, typically reused across
    chunks) the chunk is written into its first bytes and a memoryview of exactly those bytes is
    returned; otherwise a new ``bytes`` is.

    Raises IntegrityError when the payload is damaged (:class:`~ciuic.errors.UnsupportedFormat`
    when a newer ciuic wrote it), ConfigurationError when ``out`` does not fit it.
    """
    buf = _byte_view(payload, "payload")
    header = _parse(buf)
    size, itemsize = header.raw_len, header.itemsize
    n = size // itemsize
    if out is None:
        target: memoryview = memoryview(bytearray(size))
    else:
        target = _byte_view(out, "out")
        if target.readonly:
            raise ConfigurationError("out must be a writable buffer")
        if target.nbytes < size:
            raise ConfigurationError(
                f"out has {target.nbytes} bytes, the payload decodes to {size}"
            )
        target = target[:size]
    dest: U8 = np.frombuffer(target, dtype=np.uint8)
    values = dest[: n * itemsize].reshape(n, itemsize)
    dctx = _contexts.dctx
    offset = header.start
    for k, (method, length) in enumerate(header.planes):
        body = buf[offset : offset + length]
        offset += length
        if method == METHOD_ZSTD:
            values[:, k] = np.frombuffer(_unzstd(dctx, body, n), dtype=np.uint8)
        elif method == METHOD_NIBBLE:
            _nibble_decode(dctx, body, values[:, k])
        else:
            values[:, k] = np.frombuffer(body, dtype=np.uint8)
    dest[n * itemsize :] = np.frombuffer(buf[offset:], dtype=np.uint8)
    return bytes(target) if out is None else target


def _unzstd(dctx: zstandard.ZstdDecompressor, frame: memoryview, n: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise _damaged(f"bad zstd frame header ({exc})") from None
    if declared != n:
        raise _damaged(f"a compressed plane declares {declared} bytes where {n} are expected")
    try:
        plane = dctx.decompress(frame, max_output_size=n, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise _damaged(f"a compressed plane does not decode ({exc})") from None
    if len(plane) != n:
        raise _damaged(f"a compressed plane decodes to {len(plane)} bytes, not {n}")
    return plane


def measure(sample: Bytes, itemsize: int, float_kind: str,
            nbytes: int = SAMPLE_BYTES) -> tuple[float, float, float] | None:
    """(encoded size / raw size, encoding seconds per raw byte, decoding seconds per raw byte)
    of the first ``nbytes`` of ``sample``, or None when it does not compress.

    Encodes and decodes twice each and keeps the faster runs (the first also pays for this
    thread's zstd context set-up); the time is on the calling thread, i.e. per core.
    """
    view = _byte_view(sample, "sample")[:nbytes]
    _kind(float_kind, itemsize)
    encoding = decoding = math.inf
    payload = None
    for _ in range(2):
        start = time.perf_counter()
        payload = encode(view, itemsize, float_kind=float_kind)
        encoding = min(encoding, time.perf_counter() - start)
        if payload is None:
            return None
    assert payload is not None
    out = memoryview(bytearray(view.nbytes))
    for _ in range(2):
        start = time.perf_counter()
        decode(payload, out)
        decoding = min(decoding, time.perf_counter() - start)
    per_byte = 1 / view.nbytes
    return len(payload) * per_byte, max(encoding, 1e-9) * per_byte, max(decoding, 1e-9) * per_byte

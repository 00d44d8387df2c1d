"""The float-aware codec (ciuic.floatcodec): bit-exact round trips, ratios, deltas, damage."""

from __future__ import annotations

import math
import struct
import threading
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ciuic.errors import ConfigurationError, IntegrityError
from ciuic.format import floatcodec as fc

KINDS = {
    "f32": (4, torch.float32, np.uint32),
    "bf16": (2, torch.bfloat16, np.uint16),
    "f16": (2, torch.float16, np.uint16),
    "f64": (8, torch.float64, np.uint64),
}
INF = math.inf


def weights(kind: str, n: int, seed: int = 0, std: float = 0.02) -> bytes:
    """``n`` values of normal(0, std) weights of ``kind``, as little-endian bytes."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g, dtype=torch.float64) * std).to(KINDS[kind][1])
    return t.view(torch.uint8).numpy().tobytes()


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def roundtrip(data: bytes, kind: str) -> bytes:
    itemsize = KINDS[kind][0]
    payload = fc.encode(data, itemsize, float_kind=kind, max_ratio=INF)
    assert payload is not None
    out = fc.decode(payload)
    assert isinstance(out, bytes)
    assert out == data
    return payload


def plane_methods(payload: bytes) -> list[int]:
    itemsize = payload[4]
    return [payload[16 + 5 * k] for k in range(itemsize)]


def top_plane_body(payload: bytes) -> bytes:
    itemsize = payload[4]
    lengths = [struct.unpack_from("<I", payload, 17 + 5 * k)[0] for k in range(itemsize)]
    start = 16 + 5 * itemsize + 4 + sum(lengths[:-1])
    return payload[start : start + lengths[-1]]


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("n", [1, 63, 64, 65, 1001, 100_003])
def test_roundtrip_weights(kind: str, n: int) -> None:
    roundtrip(weights(kind, n), kind)


@pytest.mark.parametrize("kind", list(KINDS))
def test_special_values_roundtrip_bit_exact(kind: str) -> None:
    """NaNs with payloads and either sign, infinities, -0.0, denormals, extremes: bit for bit."""
    itemsize, _, utype = KINDS[kind]
    bits = itemsize * 8
    exp_bits = {"f32": 8, "bf16": 8, "f16": 5, "f64": 11}[kind]
    mant_bits = bits - 1 - exp_bits
    sign = 1 << (bits - 1)
    exp_all = ((1 << exp_bits) - 1) << mant_bits
    mant_all = (1 << mant_bits) - 1
    specials = [
        exp_all,  # +inf
        sign | exp_all,  # -inf
        exp_all | 1,  # signalling NaN, payload 1
        exp_all | (1 << (mant_bits - 1)),  # quiet NaN
        sign | exp_all | mant_all,  # negative NaN, all payload bits
        exp_all | (mant_all & 0x5555555555555555),  # NaN, odd payload
        0,  # +0.0
        sign,  # -0.0
        1,  # smallest denormal
        sign | 1,
        mant_all,  # largest denormal
        exp_all - 1,  # largest finite
        sign | (exp_all - 1),
    ]
    special = np.array(specials, dtype=utype)
    base = np.frombuffer(weights(kind, 50_000, seed=3), dtype=utype).copy()
    # Sprinkle them into weights (rare: the nibble code escapes them) and also as a dense block.
    base[::997] = np.resize(special, base[::997].size)
    data = base.tobytes() + np.tile(special, 40).tobytes()
    roundtrip(data, kind)
    roundtrip(np.tile(special, 4000).tobytes(), kind)
    # Check the decoded values as floats too (NaN payloads survive, -0.0 keeps its sign).
    payload = fc.encode(data, itemsize, float_kind=kind, max_ratio=INF)
    assert payload is not None
    back = np.frombuffer(fc.decode(payload), dtype=utype)
    assert np.array_equal(back, np.frombuffer(data, dtype=utype))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 9, 63, 64, 65, 1000, 4097, 100_003])
def test_roundtrip_random_bytes_any_length(kind: str, n: int) -> None:
    roundtrip(random_bytes(n, seed=n), kind)


def test_empty_input() -> None:
    assert fc.encode(b"", 4, float_kind="f32") is None
    payload = fc.encode(b"", 4, float_kind="f32", max_ratio=INF)
    assert payload is not None
    assert fc.decode(payload) == b""
    out = bytearray(8)
    assert len(fc.decode(payload, memoryview(out))) == 0


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("extra", [1, 3, 7])
def test_length_not_multiple_of_itemsize(kind: str, extra: int) -> None:
    """The last chunk of a tensor cut at a byte boundary ends with a partial value."""
    data = weights(kind, 10_001) + random_bytes(extra, seed=extra)
    payload = roundtrip(data, kind)
    assert len(payload) < len(data)


@pytest.mark.parametrize("kind", list(KINDS))
def test_all_zeros(kind: str) -> None:
    data = bytes(1 << 20)
    payload = fc.encode(data, KINDS[kind][0], float_kind=kind)
    assert payload is not None
    assert len(payload) < 0.01 * len(data)
    assert fc.decode(payload) == data


def test_memoryview_of_a_tensor_is_accepted() -> None:
    t = torch.randn(4096) * 0.02
    view = t.numpy().data  # format "f", not bytes
    payload = fc.encode(view, 4, float_kind="f32")
    assert payload is not None
    assert fc.decode(payload) == t.numpy().tobytes()


def test_unaligned_buffers() -> None:
    data = weights("f32", 30_001)
    shifted = bytearray(len(data) + 3)
    shifted[3:] = data
    payload = fc.encode(memoryview(shifted)[3:], 4, float_kind="f32")
    assert payload is not None
    out = bytearray(len(data) + 1)
    assert bytes(fc.decode(memoryview(b"\x00" + payload)[1:], memoryview(out)[1:])) == data


def test_odd_count_and_escapes_in_both_nibble_codes() -> None:
    # Signed code (weights) with outliers that must be escaped, odd number of values.
    w = np.frombuffer(weights("f32", 100_001, seed=5), dtype=np.float32).copy()
    w[::3001] = 1e30
    payload = roundtrip(w.tobytes(), "f32")
    assert plane_methods(payload)[-1] == fc.METHOD_NIBBLE
    body = top_plane_body(payload)
    signed, _base, escapes = struct.unpack_from("<BBI", body)
    assert signed == 1 and escapes >= 30
    # Unsigned code: positive values over 16 exponent bytes (wider than the signed window).
    rng = np.random.default_rng(1)
    v = (2.0 ** rng.integers(-40, -14, 200_001)).astype(np.float32) * rng.uniform(1, 2, 200_001)
    v = v.astype(np.float32)
    v[::4001] = 3e38  # escapes
    payload = roundtrip(v.tobytes(), "f32")
    assert plane_methods(payload)[-1] == fc.METHOD_NIBBLE
    signed, _base, escapes = struct.unpack_from("<BBI", top_plane_body(payload))
    assert signed == 0 and escapes >= 40


def test_top_plane_falls_back_to_plain_zstd_when_too_spread() -> None:
    # f16's top byte holds 2 mantissa bits: too many distinct values for the nibble code.
    payload = roundtrip(weights("f16", 200_000), "f16")
    assert plane_methods(payload)[-1] == fc.METHOD_ZSTD


# -- ratios (deterministic for a fixed seed) -----------------------------------------------------


def test_ratio_target_fp32() -> None:
    data = weights("f32", 1 << 20)  # one 4 MiB chunk
    payload = fc.encode(data, 4, float_kind="f32")
    assert payload is not None
    ratio = len(payload) / len(data)
    assert ratio <= 0.85, ratio
    assert plane_methods(payload) == [fc.METHOD_RAW] * 3 + [fc.METHOD_NIBBLE]
    assert fc.decode(payload) == data


def test_ratio_target_bf16() -> None:
    data = weights("bf16", 2 << 20)
    payload = fc.encode(data, 2, float_kind="bf16")
    assert payload is not None
    ratio = len(payload) / len(data)
    assert ratio <= 0.70, ratio
    assert fc.decode(payload) == data


def test_adam_second_moment_compresses() -> None:
    g = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(200_000, generator=g)) * 1e-3
    v = torch.zeros(200_000)
    for _ in range(10):
        v = 0.999 * v + 0.001 * (scale * torch.randn(200_000, generator=g)) ** 2
    data = v.numpy().tobytes()
    payload = roundtrip(data, "f32")
    assert len(payload) < 0.85 * len(data)


# -- adaptive: None and measure ------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_incompressible_returns_none(kind: str) -> None:
    assert fc.encode(random_bytes(1 << 20), KINDS[kind][0], float_kind=kind) is None


def test_measure_reports_ratio_and_time_or_none() -> None:
    measured = fc.measure(memoryview(weights("f32", 1 << 18)), 4, "f32")
    assert measured is not None
    ratio, encoding, decoding = measured
    assert 0 < ratio < 0.95 and encoding > 0 and decoding > 0
    assert fc.measure(memoryview(random_bytes(1 << 18)), 4, "f32") is None
    assert fc.measure(memoryview(b""), 4, "f32") is None


def test_a_newer_payload_is_unsupported_not_damaged() -> None:
    """Flags and versions this ciuic does not know are a newer format (typed, so that a reader
    does not rewrite or discard an intact chunk); a chunk frame names the key."""
    from ciuic.errors import UnsupportedFormat
    from ciuic.format import chunks

    data = weights("f32", 4096)
    payload = bytearray(fc.encode(data, 4, float_kind="f32", max_ratio=INF) or b"")
    head_len = 16 + 5 * 4

    def with_byte(at: int, value: int) -> bytes:
        out = bytearray(payload)
        out[at] = value
        out[head_len:head_len + 4] = zlib.crc32(out[:head_len]).to_bytes(4, "little")
        return bytes(out)

    flagged = with_byte(5, 0x01)  # the XOR-delta flag of earlier drafts: never written
    with pytest.raises(UnsupportedFormat, match="unknown flags"):
        fc.decode(flagged)
    newer = with_byte(2, 2)
    with pytest.raises(UnsupportedFormat, match="payload version 2"):
        fc.decode(newer)
    damaged = bytearray(payload)
    damaged[2] = 2  # the checksum no longer matches: damage, whatever the byte says
    with pytest.raises(IntegrityError, match=r"damaged.*version byte says 2") as d:
        fc.decode(bytes(damaged))
    assert not isinstance(d.value, UnsupportedFormat)
    with pytest.raises(UnsupportedFormat) as e:
        chunks.decode_payload("chunks/ab/x", chunks.CODEC_FLOAT, newer, len(data))
    assert e.value.key == "chunks/ab/x"


def test_bad_arguments() -> None:
    with pytest.raises(ConfigurationError, match="float kind"):
        fc.encode(b"abcd", 4, float_kind="f8")
    with pytest.raises(ConfigurationError, match="itemsize"):
        fc.encode(b"abcd", 2, float_kind="f32")
    strided = memoryview(bytes(64))[::2]
    with pytest.raises(ConfigurationError, match="contiguous"):
        fc.encode(strided, 4, float_kind="f32")


# -- damage --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample_payload() -> tuple[bytes, bytes]:
    data = weights("f32", 20_000) + b"\x01\x02"
    payload = fc.encode(data, 4, float_kind="f32")
    assert payload is not None
    return data, payload


def test_flipped_header_bytes_are_detected(sample_payload: tuple[bytes, bytes]) -> None:
    _, payload = sample_payload
    header_len = 16 + 5 * 4 + 4
    for i in range(header_len):
        for bit in (0x01, 0x10, 0x80):
            bad = bytearray(payload)
            bad[i] ^= bit
            with pytest.raises(IntegrityError, match="damaged"):
                fc.decode(bytes(bad))


def test_truncated_or_extended_payloads_are_detected(sample_payload: tuple[bytes, bytes]) -> None:
    _, payload = sample_payload
    for cut in (0, 1, 2, 15, 16, 39, 40, 41, len(payload) // 2, len(payload) - 1):
        with pytest.raises(IntegrityError, match="damaged"):
            fc.decode(payload[:cut])
    with pytest.raises(IntegrityError, match="damaged"):
        fc.decode(payload + b"\x00")


def test_damaged_body_never_escapes_as_another_error(sample_payload: tuple[bytes, bytes]) -> None:
    """A flipped byte in the planes raises IntegrityError or decodes to the right length (the
    chunk's BLAKE3 digest, checked by the reader, catches the rest)."""
    data, payload = sample_payload
    rng = np.random.default_rng(7)
    body_start = 16 + 5 * 4 + 4
    top_start = len(payload) - 2 - len(top_plane_body(payload))
    spots = list(range(top_start, top_start + 64)) + list(
        rng.integers(body_start, len(payload), 200)
    )
    for i in spots:
        bad = bytearray(payload)
        bad[int(i)] ^= 0xFF
        try:
            out = fc.decode(bytes(bad))
        except IntegrityError:
            continue
        assert len(out) == len(data)


def test_wrong_magic_or_version_is_detected(sample_payload: tuple[bytes, bytes]) -> None:
    _, payload = sample_payload
    with pytest.raises(IntegrityError, match="magic"):
        fc.decode(b"XX" + payload[2:])
    with pytest.raises(IntegrityError, match="version"):
        fc.decode(payload[:2] + b"\x09" + payload[3:])


# -- decoding into a reused buffer ---------------------------------------------------------------


def test_decode_into_out(sample_payload: tuple[bytes, bytes]) -> None:
    data, payload = sample_payload
    out = bytearray(len(data) + 100)
    view = memoryview(out)
    got = fc.decode(payload, view)
    assert isinstance(got, memoryview)
    assert got.nbytes == len(data)
    assert got.tobytes() == data
    assert bytes(out[: len(data)]) == data
    # Reused for another, shorter chunk.
    other = weights("f32", 1000, seed=9)
    p2 = fc.encode(other, 4, float_kind="f32", max_ratio=INF)
    assert p2 is not None
    assert bytes(fc.decode(p2, view)) == other
    # An exact-size numpy buffer works too.
    arr = np.empty(len(data), dtype=np.uint8)
    fc.decode(payload, arr.data)
    assert arr.tobytes() == data


def test_decode_into_unfit_out(sample_payload: tuple[bytes, bytes]) -> None:
    data, payload = sample_payload
    with pytest.raises(ConfigurationError, match="out has"):
        fc.decode(payload, memoryview(bytearray(len(data) - 1)))
    with pytest.raises(ConfigurationError, match="writable"):
        fc.decode(payload, memoryview(bytes(len(data))))


# -- threads and properties ----------------------------------------------------------------------


def test_concurrent_use_from_threads() -> None:
    chunks = [weights(kind, 50_000, seed=i) for i, kind in enumerate(["f32", "bf16"] * 4)]
    kinds = ["f32", "bf16"] * 4
    expected = [fc.encode(c, KINDS[k][0], float_kind=k) for c, k in zip(chunks, kinds, strict=True)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(10):
                p = fc.encode(chunks[i], KINDS[kinds[i]][0], float_kind=kinds[i])
                assert p == expected[i]
                assert p is not None and fc.decode(p) == chunks[i]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(chunks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=3000), kind=st.sampled_from(list(KINDS)))
def test_property_roundtrip_arbitrary_bytes(data: bytes, kind: str) -> None:
    roundtrip(data, kind)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=64, max_value=5000),
    std=st.sampled_from([1e-30, 1e-3, 0.02, 1.0, 1e30]),
    kind=st.sampled_from(list(KINDS)),
    seed=st.integers(0, 2**16),
)
def test_property_roundtrip_float_data(n: int, std: float, kind: str, seed: int) -> None:
    roundtrip(weights(kind, n, seed=seed, std=std), kind)

"""Property-based fuzz of the format's parsers of stored bytes (manifest, body, body part, tensor
descriptor, chunk frame, sealed object): whatever the bytes, each returns a valid object or
raises the ordinary error of a damaged object (:class:`UnreadableObject` naming it; a
descriptor's :class:`IntegrityError` naming its tensor), never another exception, never a
``RecursionError``. Bounded (a few hundred examples each) so that it runs in the default suite;
``CIUIC_FUZZ_EXAMPLES=20000 pytest tests/test_format_fuzz.py`` runs a longer campaign."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ciuic.errors import CaptureError, CorruptObject, IntegrityError, UnreadableObject
from ciuic.format import canonical, chunks, floatcodec
from ciuic.format import manifest as mf
from ciuic.format.crypto import Keyring, generate_key_text, parse_key_text
from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.digest import digest
from ciuic.format.parts import BodyPart
from ciuic.format.tree import walk_leaves

FUZZ = settings(max_examples=int(os.environ.get("CIUIC_FUZZ_EXAMPLES", "150")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DESC = {"dtype": "float32", "shape": [2, 2], "nbytes": 16, "chunks": [["ab" * 32, 16]],
        "stats": {"finite": 4}}
SHARDED = {"dtype": "bfloat16", "shape": [4], "nbytes": 8, "shards": [
    {"offsets": [0], "shape": [2], "nbytes": 4, "inline": "AAAAAA=="},
    {"offsets": [2], "shape": [2], "nbytes": 4, "chunks": [["cd" * 32, 4]]}]}
STATES = {"model": {"w": {"$tensor": DESC}, "b": {"$tensor": SHARDED}},
          "extra": {"$tuple": [1, {"$float": "0.5"}, {"$bytes": "AA=="}]},
          "rng": {"$dict": [[1, "x"], [{"$tuple": [2]}, None]]}}
BODY = mf.encode_body(STATES, salt="00" * 8)
MANIFEST = mf.Manifest(
    project="p", job="j", step=7, parent="", created=mf.utc_now(0), body=digest(BODY),
    body_bytes=len(BODY), total_bytes=16, new_bytes=16, tensors=2, metrics={"loss": 0.25},
    health=mf.HealthVerdict(True, (), 0, {"model": "1.5"})).encode()
PART = BodyPart(1, {"model/w": [DESC]}, {"rng": [1, 2]}, (0,), {"model/w:0": 0}).encode()

SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                   st.text(max_size=12), st.sampled_from(["$tensor", "$float", "nan", "ab" * 32]))
JSON = st.recursive(SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=8), st.sampled_from(
        ["$tensor", "$tuple", "$dict", "$float", "$bytes", "$dtype", "$adapted", "$ndarray",
         "chunks", "shards", "inline", "shape", "nbytes", "dtype", "offsets"])), inner,
        max_size=4)), max_leaves=16)


def deep(depth: int, opener: bytes) -> bytes:
    closer = {b"[": b"]", b'{"a":': b"}"}[opener]
    return opener * depth + (b"1" + closer * depth if depth % 2 else b"")


DEEP = st.builds(deep, st.sampled_from([canonical.MAX_DEPTH - 1, canonical.MAX_DEPTH,
                                        canonical.MAX_DEPTH + 1, 999, 5_000, 50_000]),
                 st.sampled_from([b"[", b'{"a":']))


@st.composite
def replaced(draw: st.DrawFn, valid: dict[str, Any]) -> Any:
    """``valid`` with one field (at any depth) replaced by any JSON value, or deleted."""
    out: Any = _copy(valid)
    node = out
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return out
        k = draw(st.sampled_from(keys))
        child = node[k]
        if isinstance(child, (dict, list)) and child and draw(st.booleans()):
            node = child
            continue
        if isinstance(node, dict) and draw(st.integers(0, 4)) == 0:
            del node[k]
        else:
            node[k] = draw(JSON)
        return out


def _copy(value: Any) -> Any:
    return canonical.loads(canonical.dumps(value))


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` with bytes flipped, cut or inserted."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        how = draw(st.sampled_from(["flip", "cut", "insert", "truncate"]))
        if how == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif how == "cut":
            del data[at:at + draw(st.integers(1, 8))]
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at:]
    return bytes(data)


def outside(valid: bytes, structured: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Bytes an outsider may store: anything, deep nests, a valid object damaged, a valid
    object's JSON with a field replaced."""
    return st.one_of(st.binary(max_size=64), DEEP, mutated(valid), structured.map(_dumps),
                     st.just(valid))


def _dumps(value: Any) -> bytes:
    try:
        return canonical.dumps(value)
    except CaptureError:  # nested too deeply to write: the bytes of the deepest JSON instead
        return b"[" * 200 + b"]" * 200


def test_the_valid_objects_decode() -> None:
    m = mf.Manifest.decode(MANIFEST, "m")
    assert (m.step, m.body, m.metrics, m.health and m.health.norm("model")) == (
        7, digest(BODY), {"loss": 0.25}, 1.5)
    assert [p for p, _, _ in walk_leaves(mf.decode_body(BODY, "b", digest(BODY)))] == [
        "model/b", "model/w"]
    assert BodyPart.decode(PART, "p", digest(PART)).others == {"model/w:0": 0}


@FUZZ
@given(outside(MANIFEST, replaced(canonical.loads(MANIFEST))))
def test_any_manifest_bytes_decode_or_are_a_damaged_object(data: bytes) -> None:
    try:
        m = mf.Manifest.decode(data, "jobs/p/j/manifests/x.json")
    except UnreadableObject as e:
        assert e.key == "jobs/p/j/manifests/x.json" and e.reason
        return
    assert m.encode() == data


@FUZZ
@given(outside(BODY, replaced(canonical.loads(BODY))))
def test_any_body_bytes_decode_or_are_a_damaged_object(data: bytes) -> None:
    try:
        states = mf.decode_body(data, "b", digest(data))
    except UnreadableObject as e:
        assert e.key == "b"
        return
    try:
        for path, _kind, desc in walk_leaves(states):
            TensorDescriptor.from_json(desc, path)
    except IntegrityError as e:
        assert str(e)


@FUZZ
@given(outside(PART, replaced(canonical.loads(PART))))
def test_any_body_part_bytes_decode_or_are_a_damaged_object(data: bytes) -> None:
    try:
        part = BodyPart.decode(data, "p", digest(data))
    except UnreadableObject as e:
        assert e.key == "p"
        return
    again = part.encode()  # a part is checked by its digest, not held to canonical form
    assert BodyPart.decode(again, "p", digest(again)) == part


@FUZZ
@given(st.one_of(JSON, replaced(DESC), replaced(SHARDED)))
def test_any_descriptor_is_typed_or_refused_naming_its_tensor(raw: Any) -> None:
    try:
        d = TensorDescriptor.from_json(raw, "model/w")
    except IntegrityError as e:
        assert str(e).startswith("model/w: ")
        return
    assert TensorDescriptor.from_json(d.to_json(), "model/w") == d


FRAMED = chunks.header(16) + bytes(16)


@FUZZ
@given(st.one_of(st.binary(max_size=40), mutated(FRAMED),
                 st.binary(max_size=64).map(lambda p: chunks.header(16, codec=1) + p)))
def test_any_chunk_bytes_unframe_or_are_a_damaged_object(blob: bytes) -> None:
    try:
        plain = chunks.unframe("chunks/ab/x", blob, digest(bytes(16)), 16)
    except UnreadableObject as e:
        assert e.key == "chunks/ab/x"
        return
    assert bytes(plain) == bytes(16)


PLAIN = np.random.default_rng(0).normal(0, 0.02, 2_000).astype(np.float32).tobytes()
_PACKED = floatcodec.encode(PLAIN, 4, float_kind="f32")
assert _PACKED is not None
PACKED = b"".join(bytes(b) for b in chunks.frame(PLAIN, _PACKED))


@FUZZ
@given(mutated(PACKED))
def test_any_compressed_chunk_bytes_unframe_or_are_a_damaged_object(blob: bytes) -> None:
    try:
        plain = chunks.unframe("chunks/ab/y", blob, digest(PLAIN), len(PLAIN))
    except UnreadableObject as e:
        assert e.key == "chunks/ab/y"
        return
    assert bytes(plain) == PLAIN


KEYRING = Keyring([parse_key_text(generate_key_text())])
SEALED = b"".join(bytes(b) for b in KEYRING.seal("jobs/p/j/manifests/x.json", MANIFEST))


@FUZZ
@given(st.one_of(st.binary(max_size=64), mutated(SEALED)))
def test_any_sealed_bytes_open_or_are_a_damaged_object(blob: bytes) -> None:
    try:
        plain, _key = KEYRING.open("jobs/p/j/manifests/x.json", blob)
    except UnreadableObject as e:
        assert e.key == "jobs/p/j/manifests/x.json"
        return
    assert plain == MANIFEST


@pytest.mark.parametrize("data", [b"[" * 50_000, b'{"a":' * 50_000, deep(999, b"["),
                                  deep(canonical.MAX_DEPTH + 1, b"[")])
def test_deep_nesting_is_a_damaged_object_not_a_recursion_error(data: bytes) -> None:
    with pytest.raises(CorruptObject, match="nested"):
        mf.Manifest.decode(data, "m")
    with pytest.raises(CorruptObject, match="nested"):
        canonical.parse(data, "lease", "lease", floats=True)


def test_nesting_up_to_the_limit_is_read_and_deeper_is_not_written() -> None:
    ok: Any = 1
    for _ in range(canonical.MAX_DEPTH):
        ok = [ok]
    assert canonical.parse(canonical.dumps(ok), "k") == ok
    assert canonical.depth(canonical.dumps(ok)) == canonical.MAX_DEPTH
    assert canonical.depth(b'["[[[", {"a": "\\"]]"}]') == 2
    with pytest.raises(CaptureError, match=f"deeper than {canonical.MAX_DEPTH} levels"):
        canonical.dumps([ok])


def nesting(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    return 0


BRACKETS = st.text(alphabet='[]{}"\\\na', max_size=6)


@FUZZ
@given(st.recursive(st.one_of(BRACKETS, st.integers()), lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(BRACKETS, inner, max_size=3)), max_leaves=20))
def test_depth_counts_the_nesting_whatever_the_strings_hold(value: Any) -> None:
    """Brackets, quotes and backslashes in strings and keys do not count."""
    for data in (canonical.dumps(value), json.dumps(value, indent=1).encode()):
        assert canonical.depth(data) == nesting(value)

"""Golden bytes: the manifest and body encodings are the format; they must never drift."""

from __future__ import annotations

import pytest
import torch

from ciuic.errors import CorruptObject, UnsupportedFormat
from ciuic.format import canonical, tree
from ciuic.format import manifest as mf
from ciuic.format.chunks import HEADER_BYTES, frame, unframe
from ciuic.format.digest import digest
from ciuic.format.layout import chunk_key

GOLDEN_MANIFEST = (
    b'{"body":"' + b"cd" * 32 + b'","body_bytes":1234,"created":"2026-11-30T01:33:08.123456Z",'
    b'"format":1,"job":"run-1","kind":"ciuic.snapshot","metrics":{"loss":{"$float":"0.41"},'
    b'"ppl":{"$float":"inf"},"tokens":12},"new_bytes":4096,"parent":"' + b"ab" * 32 + b'",'
    b'"project":"demo","step":10000,"tensors":3,"total_bytes":5071616,"world_size":1}'
)
GOLDEN_ID = "8a690d7e7857e13a98f2ac94fac0df06f22035e2ce4fcba4d1848168d4c56b5d"
GOLDEN_BODY = (
    b'{"format":1,"kind":"ciuic.body","salt":"0011223344556677","states":{"extra":{"$dict":[[1,{"$tuple":[{"$float":"0.5"},'
    b'null,true]}],["$x",{"$bytes":"AAE="}]]},"model":{"name":"\xc3\xa9","w":{"$tensor":'
    b'{"dtype":"bfloat16","inline":"AAAAAA==","nbytes":4,"shape":[2]}}}}}'
)
GOLDEN_BODY_DIGEST = "d2ee3548eb54f792fe902951f5ea0768ba076269bdedf85848a793b6d9cb38fd"


def golden_manifest() -> mf.Manifest:
    return mf.Manifest(project="demo", job="run-1", step=10000, parent="ab" * 32,
                       created="2026-11-30T01:33:08.123456Z", body="cd" * 32, body_bytes=1234,
                       total_bytes=5071616, new_bytes=4096, tensors=3, world_size=1,
                       metrics={"loss": 0.41, "tokens": 12, "ppl": float("inf")})


def test_blake3_is_the_digest() -> None:
    assert digest(b"") == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


def test_manifest_encoding_is_pinned() -> None:
    m = golden_manifest()
    assert m.encode() == GOLDEN_MANIFEST
    assert m.id == GOLDEN_ID == digest(GOLDEN_MANIFEST)


def test_manifest_round_trips_from_golden_bytes() -> None:
    m = mf.Manifest.decode(GOLDEN_MANIFEST)
    assert m == golden_manifest()


def test_body_encoding_is_pinned() -> None:
    leaves: list[tree.Leaf] = []
    states = {
        "model": tree.encode({"w": torch.zeros(2, dtype=torch.bfloat16), "name": "é"}, "model",
                             leaves),
        "extra": tree.encode({1: (0.5, None, True), "$x": b"\x00\x01"}, "extra", leaves),
    }
    leaves[0].descriptor.update({"dtype": "bfloat16", "shape": [2], "nbytes": 4,
                                 "inline": "AAAAAA=="})
    body = mf.encode_body(states, salt="0011223344556677")
    assert body == GOLDEN_BODY
    assert digest(body) == GOLDEN_BODY_DIGEST
    assert mf.decode_body(body, "k", GOLDEN_BODY_DIGEST) == states


def test_non_canonical_manifest_is_rejected() -> None:
    spaced = GOLDEN_MANIFEST.replace(b",", b", ", 1)
    with pytest.raises(CorruptObject, match="canonical"):
        mf.Manifest.decode(spaced)


def test_manifest_with_a_float_is_rejected() -> None:
    with pytest.raises(CorruptObject, match="floating-point"):
        mf.Manifest.decode(GOLDEN_MANIFEST.replace(b'"step":10000', b'"step":1.5'))


def test_manifest_from_newer_format_says_upgrade() -> None:
    """A newer format is not damage: the type says so (readers keep and skip it)."""
    with pytest.raises(UnsupportedFormat, match="upgrade ciuic") as e:
        mf.Manifest.decode(GOLDEN_MANIFEST.replace(b'"format":1', b'"format":3'))
    assert not isinstance(e.value, CorruptObject)


def test_canonical_json_rejects_floats_and_sorts_keys() -> None:
    assert canonical.dumps({"b": 1, "a": [True, None, "x"]}) == b'{"a":[true,null,"x"],"b":1}'
    with pytest.raises(TypeError, match="float"):
        canonical.dumps({"a": 0.5})
    with pytest.raises(TypeError, match="non-string key"):
        canonical.dumps({1: 2})


def test_chunk_frame_layout_and_check() -> None:
    plain = b"hello world" * 10
    d = digest(plain)
    blob = b"".join(frame(plain))
    assert blob[:4] == b"CIUK" and blob[4] == 1 and blob[5:8] == b"\x00\x00\x00"
    assert int.from_bytes(blob[8:16], "little") == len(plain)
    assert bytes(unframe(chunk_key(d), blob, d, len(plain))) == plain
    assert chunk_key(d) == f"chunks/{d[:2]}/{d}"
    flipped = bytearray(blob)
    flipped[HEADER_BYTES + 3] ^= 0x10
    with pytest.raises(CorruptObject, match="does not match its name") as e:
        unframe(chunk_key(d), bytes(flipped), d, len(plain))
    assert e.value.key == chunk_key(d)
    with pytest.raises(CorruptObject, match=r"truncated|length"):
        unframe(chunk_key(d), blob[:-5], d, len(plain))


GOLDEN_PART = (b'{"format":3,"kind":"ciuic.part","others":{"model/v":0},"rank":1,"reads":[0],'
               b'"shards":{"model/w":[{"inline":"AAAAAA==","nbytes":4,"offsets":[2],'
               b'"shape":[2]}]},"state":{"rng":{"seed":3}}}')


def test_golden_body_part_and_split_index() -> None:
    """A body in parts (format 3): a rank's part and the index's split descriptor."""
    from ciuic.format.parts import BodyPart

    part = BodyPart(1, {"model/w": [{"offsets": [2], "shape": [2], "nbytes": 4,
                                     "inline": "AAAAAA=="}]}, {"rng": {"seed": 3}}, (0,),
                    {"model/v": 0})
    assert part.encode() == GOLDEN_PART
    assert digest(GOLDEN_PART) == (
        "99781f3a43f31edc23af6fd2281521461a43ec06be74870a94fb6df588461c4d")
    assert BodyPart.decode(GOLDEN_PART, "k", digest(GOLDEN_PART)) == part
    index = mf.encode_body({"model": {"w": {"$tensor": {"dtype": "float32", "nbytes": 16,
                                                        "shape": [4], "split": True}}},
                            "dist": {"layout": "dcp-fqn", "parts": [["ab" * 32, 120]],
                                     "world_size": 1}},
                           salt="0011223344556677", distributed=True, split=True)
    assert index == (
        b'{"format":3,"kind":"ciuic.body","salt":"0011223344556677","states":{"dist":{"layout":'
        b'"dcp-fqn","parts":[["' + b"ab" * 32 + b'",120]],"world_size":1},"model":{"w":'
        b'{"$tensor":{"dtype":"float32","nbytes":16,"shape":[4],"split":true}}}}}')
    assert mf.decode_body(index, "k", digest(index))["dist"]["world_size"] == 1


def test_the_box_table_has_fixed_bytes() -> None:
    """The format's golden bytes, extended (format.md, "Box table"): one class of two tensors
    sharded over two ranks."""
    from ciuic.format.boxes import BoxTable
    from ciuic.format.digest import digest

    table = BoxTable.build({"k": ["model/w", "optimizer/state/w/exp_avg"]},
                           [(1, [("k", [2, 0], [2, 16])]), (0, [("k", [0, 0], [2, 16])])])
    golden = (b'{"classes":[{"boxes":[[[0,0],[2,16],[0]],[[2,0],[2,16],[1]]],'
              b'"paths":["model/w","optimizer/state/w/exp_avg"]}],"format":1,'
              b'"kind":"ciuic.boxes"}')
    assert table.encode() == golden
    assert BoxTable.decode(golden, "k", digest(golden)) == table

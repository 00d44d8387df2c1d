"""The tensor descriptor's typed form (format/descriptor.py): it reads what the writer writes,
byte for byte, keeps fields a later ciuic adds, and refuses a malformed one with the path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ciuic.chain.repo import Repository
from ciuic.chain.writer import ChunkCache, write_leaves
from ciuic.errors import IntegrityError
from ciuic.format import canonical
from ciuic.format.crypto import ObjectCodec
from ciuic.format.descriptor import ChunkRef, Shard, TensorDescriptor
from ciuic.format.tree import Leaf


def test_what_the_writer_writes_reads_back_to_the_same_bytes(tmp_path: Path) -> None:
    repo = Repository.open(tmp_path / "s")
    leaves = [Leaf("a", torch.arange(4.0), {}), Leaf("b", torch.randn(300_000), {}),
              Leaf("c", torch.arange(100_000, dtype=torch.int64), {})]
    write_leaves(repo, leaves, ChunkCache(), ObjectCodec())
    repo.close()
    for leaf in leaves:
        typed = TensorDescriptor.from_json(leaf.descriptor, leaf.path)
        assert typed == leaf.described
        assert canonical.dumps(typed.to_json()) == canonical.dumps(leaf.descriptor)
    inline, floats, ints = (leaf.described for leaf in leaves)
    assert inline is not None and inline.inline is not None and inline.chunks is None
    assert floats is not None and floats.chunks and floats.stats is not None
    assert sum(c.nbytes for c in floats.chunks) == floats.nbytes == 1_200_000
    assert ints is not None and ints.stats is None and ints.shape == (100_000,)


def test_unknown_fields_are_kept_and_shards_read_back() -> None:
    raw = {"dtype": "float32", "shape": [4, 2], "nbytes": 32, "later": {"x": 1}, "shards": [
        {"offsets": [0, 0], "shape": [2, 2], "nbytes": 16, "chunks": [["d" * 64, 16]]},
        {"offsets": [2, 0], "shape": [2, 2], "nbytes": 16, "inline": "", "note": "kept"}]}
    d = TensorDescriptor.from_json(raw, "model/w")
    assert d.extra == {"later": {"x": 1}} and d.shards is not None
    assert d.shards[0] == Shard((0, 0), (2, 2), 16, chunks=(ChunkRef("d" * 64, 16),))
    assert d.shards[1].extra == {"note": "kept"}
    assert canonical.dumps(d.to_json()) == canonical.dumps(raw)


@pytest.mark.parametrize("raw, message", [
    ({"shape": [2], "nbytes": 8, "inline": ""}, "malformed tensor descriptor: 'dtype'"),
    ({"dtype": "float32", "shape": [2], "nbytes": "8", "inline": ""}, "expected an integer"),
    ({"dtype": "float32", "shape": [2], "nbytes": 8}, "needs one of 'inline', 'chunks'"),
    ({"dtype": "float32", "shape": [2], "nbytes": 8, "inline": "", "chunks": []}, "needs one"),
    ({"dtype": "float32", "shape": [2], "nbytes": 8, "chunks": [["d", 4]]}, "do not add up"),
    ({"dtype": "float32", "shape": [2], "nbytes": 8, "chunks": [["d"]]}, "[digest, nbytes]"),
    ({"dtype": "float32", "shape": True, "nbytes": 8, "inline": ""}, "expected a list"),
    ({"dtype": "float32", "shape": [2], "nbytes": 8, "shards": [{"shape": [2]}]},
     "'offsets'"),
    ([1, 2], "a descriptor is an object"),
])
def test_a_malformed_descriptor_is_refused_naming_the_tensor(raw: object, message: str) -> None:
    with pytest.raises(IntegrityError, match="model/w: .*" + message.replace("[", r"\[")
                       .replace("]", r"\]")):
        TensorDescriptor.from_json(raw, "model/w")

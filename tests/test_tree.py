from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from ciuic.errors import CaptureError, IntegrityError
from ciuic.format import canonical, tree


def round_trip(value: Any) -> Any:
    leaves: list[tree.Leaf] = []
    enc = tree.encode(value, "v", leaves)
    canonical.dumps(enc)  # must be canonical-JSON-able (no floats)
    by_path = {leaf.path: leaf.value for leaf in leaves}
    return tree.decode(enc, "v", lambda path, kind, desc: by_path[path])


def test_plain_values_round_trip_exactly() -> None:
    value = {"a": 1, "b": [1, "x", None, True, False], "c": (1, (2, 3)), "big": 2**80,
             "f": 0.1 + 0.2, "neg": -0.0, "tiny": 5e-324, "s": "ü✓"}
    back = round_trip(value)
    assert back == value
    assert isinstance(back["c"], tuple) and isinstance(back["c"][1], tuple)
    assert math.copysign(1, back["neg"]) == -1


def test_special_floats() -> None:
    back = round_trip([float("nan"), float("inf"), float("-inf")])
    assert math.isnan(back[0]) and back[1] == math.inf and back[2] == -math.inf


def test_int_keys_and_dollar_keys_keep_type_and_order() -> None:
    value = {3: "c", 1: "a", "$ref": 2, (1, 2): "t"}
    back = round_trip(value)
    assert back == value and list(back) == [3, 1, "$ref", (1, 2)]


def test_bytes_dtypes_and_numpy_scalars() -> None:
    back = round_trip({"b": b"\x00\xff", "dt": torch.bfloat16, "n": np.float32(1.5),
                       "i": np.int64(7)})
    assert back == {"b": b"\x00\xff", "dt": torch.bfloat16, "n": 1.5, "i": 7}


def test_tensors_are_leaves_with_paths() -> None:
    leaves: list[tree.Leaf] = []
    t = torch.ones(3)
    enc = tree.encode({"state": {0: {"exp_avg": t}}, "arr": np.zeros(2)}, "optimizer", leaves)
    assert [leaf.path for leaf in leaves] == ["optimizer/state/0/exp_avg", "optimizer/arr"]
    assert leaves[0].value is t
    assert list(enc["state"]) == ["$dict"]


def test_path_components_are_escaped() -> None:
    leaves: list[tree.Leaf] = []
    tree.encode({"a/b%": torch.zeros(1)}, "x", leaves)
    assert leaves[0].path == "x/a%2Fb%25"


def test_unsupported_values_name_the_path() -> None:
    class Opaque:
        pass

    with pytest.raises(CaptureError, match=r"model/layer/cfg: a .*Opaque cannot be stored"):
        tree.encode({"layer": {"cfg": Opaque()}}, "model", [])
    with pytest.raises(CaptureError, match="sparse"):
        tree.encode(torch.eye(2).to_sparse(), "s", [])
    with pytest.raises(CaptureError, match="Python objects"):
        tree.encode(np.array([object()]), "o", [])


def test_unknown_tag_or_dtype_is_an_integrity_error() -> None:
    with pytest.raises(IntegrityError, match="unknown tag"):
        tree.decode({"$pickle": "x"}, "v", lambda *a: None)
    with pytest.raises(IntegrityError, match="unknown dtype"):
        tree.torch_dtype("object")

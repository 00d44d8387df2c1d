"""Adapters: explicit conversions for framework classes the state tree cannot hold."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import pytest
import torch

from ciuic import register_adapter
from ciuic.errors import CaptureError, ConfigurationError
from ciuic.format import adapters, canonical, tree


@dataclasses.dataclass
class TrainState:
    step: int
    loss: float
    history: list[dict[str, float]]
    weights: torch.Tensor


class HParams(dict):  # type: ignore[type-arg]  # like Lightning's AttributeDict
    pass


class Phase(enum.Enum):
    WARMUP = "warmup"
    MAIN = "main"


class Loop:
    def __init__(self, n: int) -> None:
        self.n = n


class SubLoop(Loop):
    pass


register_adapter(TrainState, "tests.TrainState",
                 save=lambda s: {f.name: getattr(s, f.name) for f in dataclasses.fields(s)},
                 load=lambda d: TrainState(**d))
register_adapter(HParams, "tests.HParams", save=dict, load=HParams)
register_adapter(Phase, "tests.Phase", save=lambda p: p.value, load=Phase)
register_adapter(Loop, "tests.Loop", save=lambda loop: {"n": loop.n},
                 load=lambda d: Loop(d["n"]))


def encode(value: Any) -> tuple[Any, dict[str, Any]]:
    leaves: list[tree.Leaf] = []
    enc = tree.encode(value, "v", leaves)
    canonical.dumps(enc)  # canonical JSON accepts it
    return enc, {leaf.path: leaf.value for leaf in leaves}


def round_trip(value: Any) -> Any:
    enc, by_path = encode(value)
    return tree.decode(enc, "v", lambda path, kind, desc: by_path[path])


def test_a_dataclass_with_tensors_and_floats_round_trips_through_its_adapter() -> None:
    state = TrainState(7, 0.1 + 0.2, [{"loss": 2.5}], torch.arange(4.0))
    enc, leaves = encode({"trainer": state})
    assert enc["trainer"]["$adapted"]["type"] == "tests.TrainState"
    assert list(leaves) == ["v/trainer/weights"]  # the tensor is still a leaf, by its path
    back = round_trip({"trainer": state})["trainer"]
    assert isinstance(back, TrainState)
    assert (back.step, back.loss, back.history) == (7, 0.1 + 0.2, [{"loss": 2.5}])
    assert torch.equal(back.weights, state.weights)


def test_a_registered_dict_subclass_and_an_enum_keep_their_class() -> None:
    back = round_trip({"hp": HParams(lr=0.1, layers=[1, 2]), "phase": Phase.MAIN})
    assert type(back["hp"]) is HParams and back["hp"] == {"lr": 0.1, "layers": [1, 2]}
    assert back["phase"] is Phase.MAIN
    assert type(round_trip({"d": {"a": 1}})["d"]) is dict  # plain dicts stay plain


def test_a_subclass_uses_the_nearest_registered_base() -> None:
    back = round_trip(SubLoop(3))
    assert type(back) is Loop and back.n == 3


def test_listing_leaves_calls_no_adapter() -> None:
    enc, _ = encode(TrainState(1, 1.0, [], torch.zeros(2)))
    assert [(p, k) for p, k, _ in tree.walk_leaves(enc, "v")] == [("v/weights", "tensor")]
    plain = tree.decode(enc, "v", lambda *a: None, adapt=False)
    assert plain["step"] == 1 and isinstance(plain, dict)


def test_an_unregistered_name_on_the_load_path_is_a_clear_error() -> None:
    enc = {"$adapted": {"type": "otherlib.State", "value": {"x": 1}}}
    with pytest.raises(ConfigurationError, match=r"v/s: .*'otherlib.State'.*register_adapter"):
        tree.decode({"s": enc}, "v", lambda *a: None)


def test_a_class_without_adapter_names_the_value_and_the_way_out() -> None:
    class Opaque:
        pass

    with pytest.raises(CaptureError, match=r"v/cb/state: .*Opaque cannot be stored.*"
                                           r"register_adapter"):
        encode({"cb": {"state": Opaque()}})


def test_registration_mistakes_raise() -> None:
    with pytest.raises(ConfigurationError, match="already registered"):
        register_adapter(SubLoop, "tests.Loop", save=dict, load=dict)
    with pytest.raises(ConfigurationError, match="already has the adapter"):
        register_adapter(Loop, "tests.Loop2", save=dict, load=dict)
    with pytest.raises(ConfigurationError, match="not valid"):
        register_adapter(Loop, "no spaces", save=dict, load=dict)
    with pytest.raises(TypeError):
        register_adapter("Loop", "tests.X", save=dict, load=dict)  # type: ignore[arg-type]


def test_an_adapter_that_returns_its_own_class_or_fails_is_a_capture_error() -> None:
    class Loopy:
        pass

    register_adapter(Loopy, "tests.Loopy", save=lambda v: v, load=lambda v: v)
    with pytest.raises(CaptureError, match="returned a value of the class it adapts"):
        encode(Loopy())

    class Broken:
        pass

    register_adapter(Broken, "tests.Broken", save=lambda v: 1 / 0, load=lambda v: v)
    with pytest.raises(CaptureError, match=r"tests\.Broken.*failed to save.*ZeroDivisionError"):
        encode(Broken())


def test_a_failing_load_names_the_adapter() -> None:
    enc = {"$adapted": {"type": "tests.Loop", "value": {"wrong": 1}}}
    with pytest.raises(ConfigurationError, match=r"'tests\.Loop' could not rebuild.*KeyError"):
        tree.decode(enc, "v", lambda *a: None)
    assert adapters.adapter_for(Loop(1)) is not None

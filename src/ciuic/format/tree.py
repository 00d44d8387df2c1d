"""State values <-> canonical-JSON trees with tensor leaves (docs/format.md, "State trees").

A state value (a ``state_dict()``, RNG states, user extras) is a nest of dicts, lists, tuples,
scalars, tensors and NumPy arrays. ``encode`` turns it into a JSON tree that canonical JSON accepts
and collects the tensors as :class:`Leaf` objects; the writer later fills each leaf's descriptor in
place. ``decode`` walks the tree back, asking a callback for each tensor. Nothing here unpickles or
imports code by name: the only types that come back are the ones listed below.

Tagged forms (an object with exactly one key that starts with ``$``)::

    {"$float": "0.41"}            float, by Python's round-trip repr ("nan", "inf", "-inf" too)
    {"$tuple": [...]}             tuple
    {"$dict": [[k, v], ...]}      dict whose keys are not all strings, or start with "$"
    {"$bytes": "<base64>"}        bytes
    {"$dtype": "float32"}         torch.dtype
    {"$tensor": {descriptor}}     torch.Tensor, bytes in chunks or inline
    {"$ndarray": {descriptor}}    numpy.ndarray
    {"$npscalar": {descriptor}}   NumPy scalar (np.float32(0.1) comes back as np.float32)
    {"$adapted": {"type": NAME, "value": tree}}
                                  a value of a class with a registered adapter (format/adapters.py)
"""

from __future__ import annotations

import base64
import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ciuic.errors import CaptureError, IntegrityError
from ciuic.format import adapters
from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.digest import digest

if TYPE_CHECKING:
    import numpy as np
    import torch

Json = Any
# torch and NumPy are imported only where a tensor or an array is met: a value can only be one
# when its module is loaded already (sys.modules), so decoding a manifest, listing a body's
# leaves or encoding plain values never imports them (the command line starts at once)


def _loaded(name: str) -> Any:
    return sys.modules.get(name)


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    found = {str(dt).removeprefix("torch."): dt for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool)}
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16",
                 "uint32", "uint64"):
        if hasattr(torch, name):
            found[name] = getattr(torch, name)
    return found


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name for a torch dtype ("float32", "bfloat16", ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _torch_dtypes():
        raise CaptureError(f"tensors of dtype {dtype} cannot be stored")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a format dtype name; IntegrityError for unknown names."""
    try:
        return _torch_dtypes()[name]
    except KeyError:
        raise IntegrityError(f"unknown dtype {name!r} in snapshot body") from None


@dataclass
class Leaf:
    """One tensor (or NumPy array) found while encoding; ``descriptor`` is filled by the writer."""

    path: str
    value: torch.Tensor | np.ndarray
    descriptor: dict[str, Json]
    #: For one shard of a distributed tensor (DTensor): its (global shape, offsets); ``value``
    #: is then the local shard.
    shard: tuple[list[int], list[int]] | None = None
    #: (chunk size, the digest of each chunk of ``value``'s raw bytes or None where not known):
    #: staging sets the digests of chunks that did not change since the last snapshot, so the
    #: writer does not hash them again; the writer fills in the rest.
    digests: tuple[int, list[str | None]] | None = None
    #: the typed form of ``descriptor``, once the writer set it
    described: TensorDescriptor | None = None
    #: For a shard: its layout class (:func:`dtensor_layout`), the same on every rank for
    #: tensors sharded alike; None where not known.
    sharding: str | None = None
    #: For a shard: the global ranks that hold this same box (its mesh's positions that differ
    #: from this rank's only along replicated dimensions), sorted; None where not known.
    holders: tuple[int, ...] | None = None

    def describe(self, desc: TensorDescriptor) -> None:
        """Set this leaf's descriptor: the state tree holds the dict, so it is filled in place,
        once per write, from the typed record."""
        self.described = desc
        self.descriptor.clear()
        self.descriptor.update(desc.to_json())

    @property
    def nbytes(self) -> int:
        torch = _loaded("torch")
        if torch is not None and isinstance(self.value, torch.Tensor):
            return int(self.value.numel() * self.value.element_size())
        return int(self.value.nbytes)


def escape(component: str) -> str:
    """Escape one path component so that "/" only ever separates components."""
    return component.replace("%", "%25").replace("/", "%2F")


def join(path: str, component: object) -> str:
    c = escape(str(component))
    return f"{path}/{c}" if path else c


def _plain_keys(d: dict[Any, Any]) -> bool:
    return all(isinstance(k, str) and not k.startswith("$") for k in d)


def encode(value: Any, path: str, leaves: list[Leaf]) -> Json:
    """Encode ``value`` found at ``path``; tensors are appended to ``leaves``."""
    np, torch = _loaded("numpy"), _loaded("torch")
    adapter = adapters.exact_adapter(value)
    if adapter is not None:
        return _encode_adapted(adapter, value, path, leaves)
    if np is not None and isinstance(value, np.generic):  # first: np.float64 is a float
        if value.dtype.hasobject or value.dtype.kind in "SUV":
            return encode(value.item(), path, leaves)
        desc: dict[str, Json] = {}
        leaves.append(Leaf(path, np.asarray(value), desc))
        return {"$npscalar": desc}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return {"$float": float.__repr__(value)}
    if torch is not None and isinstance(value, torch.Tensor):
        shard = dtensor_shard(value, path)
        sharding: _Class | None = None
        if shard is not None:
            sharding = dtensor_class(value)
            value = value.to_local()
        _check_tensor(value, path)
        desc = {}
        leaves.append(Leaf(path, value, desc, shard, sharding=sharding and sharding[0],
                           holders=sharding and sharding[1]))
        return {"$tensor": desc}
    if np is not None and isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.names is not None:
            raise CaptureError(f"{path}: NumPy arrays of Python objects or structured dtypes "
                               "cannot be stored; store plain numeric arrays")
        desc = {}
        leaves.append(Leaf(path, value, desc))
        return {"$ndarray": desc}
    if torch is not None and isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        if _plain_keys(value):
            return {k: encode(v, join(path, k), leaves) for k, v in value.items()}
        _check_distinct(value, path)
        return {
            "$dict": [
                [encode(k, join(path, f"<key {i}>"), []), encode(v, join(path, k), leaves)]
                for i, (k, v) in enumerate(value.items())
            ]
        }
    if isinstance(value, tuple):  # also torch.Size and named tuples (as plain tuples)
        return {"$tuple": [encode(v, join(path, i), leaves) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, join(path, i), leaves) for i, v in enumerate(value)]
    adapter = adapters.adapter_for(value)
    if adapter is not None:
        return _encode_adapted(adapter, value, path, leaves)
    raise CaptureError(
        f"{path or 'value'}: a {type(value).__module__}.{type(value).__qualname__} cannot be "
        "stored. Snapshots hold tensors, NumPy arrays and JSON-like values (dict, list, tuple, "
        "str, int, float, bool, None, bytes); convert it, give the object "
        "state_dict()/load_state_dict() methods that return such values, or register an "
        "adapter for its class (ciuic.register_adapter)."
    )


def _encode_adapted(adapter: adapters.Adapter, value: Any, path: str, leaves: list[Leaf]
                    ) -> Json:
    try:
        plain = adapter.save(value)
    except Exception as e:
        raise CaptureError(f"{path or 'value'}: the adapter {adapter.name!r} failed to save "
                           f"it ({type(e).__name__}: {e})") from e
    if adapters.adapter_for(plain) is adapter:
        raise CaptureError(f"{path or 'value'}: the adapter {adapter.name!r} returned a value of "
                           "the class it adapts; its save must return plain values")
    return {"$adapted": {"type": adapter.name, "value": encode(plain, path, leaves)}}


def _check_distinct(d: dict[Any, Any], path: str) -> None:
    """A value's place in a snapshot is named by its key's text: ``{0: a, "0": b}`` would give
    two tensors one name (one staging buffer, one restored value)."""
    seen: dict[str, Any] = {}
    for k in d:
        name = str(k)
        if name in seen:
            raise CaptureError(
                f"{path or 'value'}: the keys {seen[name]!r} and {k!r} of one dict have the same "
                f"text {name!r}, which a snapshot names them by; use keys whose text differs "
                "(all str, or all int)")
        seen[name] = k


def dtensor_shard(t: torch.Tensor, path: str) -> tuple[list[int], list[int]] | None:
    """(global shape, offsets) of a DTensor's local shard, from the chunk list DCP itself
    saves (``__create_chunk_list__``); None for a plain tensor."""
    if type(t).__name__ != "DTensor" or not hasattr(t, "__create_chunk_list__"):
        return None
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1:
        raise CaptureError(f"{path}: a DTensor whose local part is {len(chunks)} boxes of the "
                           "global tensor (strided sharding) is not supported yet")
    box = chunks[0]
    if list(box.sizes) != list(t.to_local().shape):  # type: ignore[attr-defined]
        raise CaptureError(f"{path}: the DTensor's local shard {list(t.to_local().shape)} "  # type: ignore[attr-defined]
                           f"is not the box {list(box.sizes)} it reports")
    return [int(x) for x in t.shape], [int(x) for x in box.offsets]


#: id(mesh) -> (the mesh, kept alive so that its id is not reused; its ranks' text; this rank's
#: coordinate in it; the class and holders of each (global shape, placements) on it: a
#: snapshot's capture asks once per tensor, and the digest alone costs tens of microseconds)
_Class = tuple[str, tuple[int, ...] | None]  # a layout class and its holders
_MESHES: dict[int, tuple[Any, str, Any, dict[tuple[Any, ...], _Class]]] = {}


def dtensor_layout(t: Any) -> str | None:
    """A DTensor's layout class: the digest of its global shape, its placements and its device
    mesh (the global rank at each position). Tensors of one class hold the same box on every
    rank (docs/format.md, "Box table"). None where the DTensor does not say."""
    found = dtensor_class(t)
    return None if found is None else found[0]


def dtensor_class(t: Any) -> _Class | None:
    """A DTensor's layout class (:func:`dtensor_layout`) and the global ranks that hold the
    same box as this rank (:func:`holders`; None where its mesh is a part of the job's ranks:
    the ranks of another sub-mesh may hold the same box, and this rank cannot name them); None
    where the DTensor does not say."""
    mesh = getattr(t, "device_mesh", None)
    placements = getattr(t, "placements", None)
    if mesh is None or placements is None:
        return None
    known = _MESHES.get(id(mesh))
    if known is None or known[0] is not mesh:  # (DeviceMesh.mesh alone costs ~20 us)
        ranks = getattr(mesh, "mesh", None)
        if ranks is None:
            return None
        coordinate = getattr(mesh, "get_coordinate", lambda: None)()
        if ranks.numel() != _world_size():  # a sub-mesh: its holders are not all known here
            coordinate = None
        known = _MESHES[id(mesh)] = (mesh, repr(ranks.tolist()), coordinate, {})
    key = (tuple(t.shape), tuple(placements))
    found = known[3].get(key)
    if found is None:
        text = repr(([int(x) for x in t.shape], [repr(p) for p in placements], known[1]))
        found = known[3][key] = (digest(text.encode()),
                                 holders(mesh.mesh, known[2], placements))
    return found


def _world_size() -> int:
    """The job's number of ranks (1 without a process group)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def holders(ranks: Any, coordinate: Any, placements: Any) -> tuple[int, ...] | None:
    """The global ranks of a device mesh (``ranks``: its tensor of global ranks) that hold the
    box the rank at ``coordinate`` holds under ``placements``: the positions that differ from
    it only along replicated mesh dimensions. None where a placement is neither sharded nor
    replicated (a partial sum), or the rank is not in the mesh."""
    if coordinate is None or len(coordinate) != len(placements):
        return None
    index: list[Any] = []
    for c, p in zip(coordinate, placements, strict=True):
        if p.is_shard() or "StridedShard" in type(p).__name__:  # (FSDP2 over TP's rows)
            index.append(int(c))
        elif p.is_replicate():
            index.append(slice(None))
        else:
            return None
    return tuple(sorted(int(r) for r in ranks[tuple(index)].flatten().tolist()))


def _check_tensor(t: torch.Tensor, path: str) -> None:
    import torch

    if t.is_sparse or t.layout != torch.strided:
        raise CaptureError(f"{path}: sparse tensors ({t.layout}) are not supported; "
                           "call .to_dense() first")
    if t.is_quantized:
        raise CaptureError(f"{path}: quantized tensors are not supported; dequantize first")
    if t.device.type == "meta":
        raise CaptureError(f"{path}: tensor is on the meta device and holds no data")
    dtype_name(t.dtype)


LoadLeaf = Callable[[str, str, dict[str, Json]], Any]


def decode(tree: Json, path: str, load_leaf: LoadLeaf, *, adapt: bool = True) -> Any:
    """Decode a tree; ``load_leaf(path, kind, descriptor)`` returns each tensor or array.

    ``adapt=False`` leaves adapted values as their plain trees (no adapter is called: for
    listing leaves, or reading a snapshot without the code that wrote it)."""
    if tree is None or isinstance(tree, (bool, str, int)):
        return tree
    if isinstance(tree, list):
        return [decode(v, join(path, i), load_leaf, adapt=adapt) for i, v in enumerate(tree)]
    if not isinstance(tree, dict):
        raise IntegrityError(f"{path}: unexpected {type(tree).__name__} in snapshot body")
    if len(tree) == 1:
        (tag, inner), = tree.items()
        if tag.startswith("$"):
            if tag == "$adapted":
                return _decode_adapted(inner, path, load_leaf, adapt)
            try:
                return _decode_tagged(tag, inner, path, load_leaf, adapt)
            except IntegrityError:
                raise
            except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as e:
                raise IntegrityError(f"{path}: malformed {tag} value in snapshot body: {e}") from e
    return {k: decode(v, join(path, k), load_leaf, adapt=adapt) for k, v in tree.items()}


def _decode_adapted(inner: Json, path: str, load_leaf: LoadLeaf, adapt: bool) -> Any:
    if not (isinstance(inner, dict) and set(inner) == {"type", "value"}
            and isinstance(inner["type"], str)):
        raise IntegrityError(f"{path}: malformed $adapted value in snapshot body")
    value = decode(inner["value"], path, load_leaf, adapt=adapt)
    return adapters.load_adapted(inner["type"], value, path) if adapt else value


def _decode_tagged(tag: str, inner: Json, path: str, load_leaf: LoadLeaf, adapt: bool) -> Any:
    if tag == "$float":
        return float(inner)
    if tag == "$tuple":
        return tuple(decode(v, join(path, i), load_leaf, adapt=adapt)
                     for i, v in enumerate(inner))
    if tag == "$dict":
        out = {}
        for i, (k, v) in enumerate(inner):
            key = decode(k, join(path, f"<key {i}>"), load_leaf, adapt=adapt)
            out[key] = decode(v, join(path, key), load_leaf, adapt=adapt)
        return out
    if tag == "$bytes":
        return base64.b64decode(inner)
    if tag == "$dtype":
        return torch_dtype(inner)
    if tag in ("$tensor", "$ndarray", "$npscalar"):
        if not isinstance(inner, dict):
            raise IntegrityError(f"{path}: malformed {tag} descriptor")
        return load_leaf(path, tag[1:], inner)
    raise IntegrityError(f"{path}: unknown tag {tag!r} in snapshot body (written by a newer "
                         "ciuic? upgrade to read it)")


def flat_tensors(value: Any, path: str, out: dict[str, torch.Tensor]) -> None:
    """Every tensor (NumPy arrays as tensors) inside ``value`` by path, paths as :func:`encode`
    makes them (at the top, with ``path`` empty, keys are used as they are)."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        out[path] = value
    elif isinstance(value, np.ndarray):
        out[path] = torch.from_numpy(value)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            flat_tensors(v, join(path, k) if path else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            flat_tensors(v, join(path, i), out)


def walk_leaves(tree: Json, path: str = "") -> list[tuple[str, str, dict[str, Json]]]:
    """Every (path, kind, descriptor) in a tree, in order, without loading anything."""
    found: list[tuple[str, str, dict[str, Json]]] = []

    def visit(path: str, kind: str, desc: dict[str, Json]) -> None:
        found.append((path, kind, desc))

    decode(tree, path, visit, adapt=False)
    return found

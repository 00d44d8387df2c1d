"""Exporting a snapshot's tensors to a plain file (``ciuic restore SNAP --to FILE``), or a
snapshot of a Hugging Face model to a ``save_pretrained`` folder (``--format hf``)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from ciuic.chain.read import read_body
from ciuic.chain.repo import Repository
from ciuic.errors import CiuicError, ConfigurationError, SnapshotNotFound
from ciuic.format.info import SnapshotInfo
from ciuic.format.tree import flat_tensors
from ciuic.restore.reader import load_states
from ciuic.words import listed

#: The file name suffixes of each file format.
SUFFIXES = {"safetensors": (".safetensors",), "torch": (".pt", ".pth", ".bin")}


def export(repo: Repository, info: SnapshotInfo, dest: Path, fmt: str | None = None,
           states: list[str] | None = None, replace: bool = False) -> dict[str, torch.Tensor]:
    """Write the tensors of ``states`` (default: the model's) to ``dest``.

    ``fmt`` is "safetensors" or "torch" (default: from the suffix; ``.safetensors``, or
    ``.pt``/``.pth``/``.bin``); a suffix of the other format is refused. The model's keys are
    kept as they are; other states' tensors are named ``STATE/PATH``. ``dest``'s folder must
    exist, and an existing ``dest`` is replaced only with ``replace``. Returns the exported
    tensors.
    """
    _check_dest(dest, replace)
    if fmt == "hf":
        return export_hf(repo, info, dest)
    if fmt is not None and fmt not in SUFFIXES:
        raise ConfigurationError(f"unknown format {fmt!r}: use --format safetensors, torch "
                                 "or hf")
    named = next((f for f, suffixes in SUFFIXES.items() if dest.suffix in suffixes), None)
    if fmt is not None and named is not None and named != fmt:
        raise ConfigurationError(f"{dest.name} names a {named} file, but the format asked for "
                                 f"is {fmt}: use a {SUFFIXES[fmt][0]} name, or --format "
                                 f"{named}")
    fmt = fmt or named
    if fmt is None:
        raise ConfigurationError(f"cannot tell the format of {dest}: use a .safetensors or .pt "
                                 "file name, or --format safetensors|torch")
    names = states or ["model"]
    loaded = _load(repo, info, names)
    tensors: dict[str, torch.Tensor] = {}
    empty = []
    for name in names:
        before = len(tensors)
        flat_tensors(loaded[name], "" if names == ["model"] else name, tensors)
        empty += [name] if len(tensors) == before else []
    if empty:  # an empty file said "Wrote 0 tensors"
        raise ConfigurationError(
            f"the {listed(empty, 'state')} of snapshot {info.short_id} ({info.ref}) "
            f"{'holds' if len(empty) == 1 else 'hold'} no tensors, only plain values (a "
            "sampler's position, counters), which restore() puts back into the object: "
            f"nothing to write to {dest}. Export states with tensors (--state model, "
            "--state optimizer, ...)")
    if fmt == "safetensors":
        _safetensors()
    # written beside it, then renamed: an existing file is replaced whole or not at all
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")
    try:
        if fmt == "safetensors":
            _safetensors()({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                           metadata={"ciuic.snapshot": info.id, "ciuic.step": str(info.step)})
        else:
            torch.save(tensors, tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as any new file (safetensors makes it 0600)
        os.replace(tmp, dest)
    except Exception as e:  # OSError, torch's RuntimeError, SafetensorError: cannot write
        raise CiuicError(f"cannot write {dest}: {e}") from e
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()  # left only when the write failed or was interrupted
    return tensors


def _check_dest(dest: Path, replace: bool) -> None:
    """Refuse, before anything is read, an export that would make folders or replace a file
    unasked."""
    if not dest.parent.is_dir():
        raise ConfigurationError(
            f"{dest.parent} is a file, not a folder: choose another --to"
            if dest.parent.exists() else
            f"the folder {dest.parent} does not exist: create it first, or choose another --to")
    if dest.exists() and not dest.is_dir() and not replace:
        raise ConfigurationError(f"{dest} exists: choose another --to, or pass --force to "
                                 "replace it")


def _load(repo: Repository, info: SnapshotInfo, names: list[str]) -> dict[str, Any]:
    """The states ``names`` of a snapshot, read and verified (the others are not read)."""
    _, trees = read_body(repo, info)
    missing = [n for n in names if n not in trees]
    if missing:
        raise SnapshotNotFound(f"snapshot {info.short_id} has no {listed(missing, 'state')}; "
                               f"it has: {', '.join(sorted(trees))}")
    _, loaded = load_states(repo, info, skip=set(trees) - set(names), adapt=False)
    return loaded


def _safetensors() -> Any:
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ConfigurationError("writing .safetensors needs the safetensors package: "
                                 "pip install 'ciuic[safetensors]'") from e
    return save_file


def export_hf(repo: Repository, info: SnapshotInfo, dest: Path) -> dict[str, torch.Tensor]:
    """Write a snapshot taken by ``ciuic.integrations.transformers`` as the folder that
    ``save_pretrained`` writes (``config.json``, ``model.safetensors``), which
    ``from_pretrained(dest)`` loads. Every key of the model's state is written, tied weights
    included (``from_pretrained`` ties them again)."""
    _, trees = read_body(repo, info)
    if "hf_config" not in trees or "model" not in trees:
        raise ConfigurationError(
            f"snapshot {info.short_id} ({info.ref}) holds no Hugging Face model config: only "
            "snapshots taken by ciuic.integrations.transformers (CiuicTrainer) export as an "
            "HF folder. Use --format safetensors for the bare tensors.")
    loaded = _load(repo, info, ["model", "hf_config"])
    tensors: dict[str, torch.Tensor] = {}
    flat_tensors(loaded["model"], "", tensors)
    save_file = _safetensors()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigurationError(f"{dest} exists and is not an empty folder: choose a new "
                                 "folder for the export")
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(loaded["hf_config"], indent=2,
                                                    sort_keys=True) + "\n", encoding="utf-8")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "ciuic.snapshot": info.id,
                            "ciuic.step": str(info.step)})
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
    except Exception as e:
        raise CiuicError(f"cannot write {dest}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tensors

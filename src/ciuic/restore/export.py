"""Exporting a snapshot's tensors to a plain file (``ciuic restore SNAP --to FILE``)."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

import torch

from ciuic.chain.repo import Repository
from ciuic.errors import CiuicError, ConfigurationError, SnapshotNotFound
from ciuic.format.info import SnapshotInfo
from ciuic.format.tree import flat_tensors
from ciuic.restore.reader import load_states


def export(repo: Repository, info: SnapshotInfo, dest: Path, fmt: str | None = None,
           states: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Write the tensors of ``states`` (default: the model's) to ``dest``.

    ``fmt`` is "safetensors" or "torch" (default: from the suffix; ``.safetensors`` or
    ``.pt``/``.pth``). The model's keys are kept as they are; other states' tensors are named
    ``STATE/PATH``. Returns the exported tensors.
    """
    if fmt is not None and fmt not in ("safetensors", "torch"):
        raise ConfigurationError(f"unknown format {fmt!r}: use --format safetensors or "
                                 "--format torch")
    fmt = fmt or ("safetensors" if dest.suffix == ".safetensors" else
                  "torch" if dest.suffix in (".pt", ".pth", ".bin") else None)
    if fmt is None:
        raise ConfigurationError(f"cannot tell the format of {dest}: use a .safetensors or .pt "
                                 "file name, or --format safetensors|torch")
    _, loaded = load_states(repo, info)
    names = states or ["model"]
    missing = [n for n in names if n not in loaded]
    if missing:
        raise SnapshotNotFound(f"snapshot {info.short_id} has no state {missing}; it has: "
                               f"{', '.join(sorted(loaded))}")
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        flat_tensors(loaded[name], "" if names == ["model"] else name, tensors)
    if fmt == "safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as e:
            raise ConfigurationError("writing .safetensors needs the safetensors package: "
                                     "pip install 'ciuic[safetensors]'") from e
    # written beside it, then renamed: an existing file is replaced whole or not at all
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if fmt == "safetensors":
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
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

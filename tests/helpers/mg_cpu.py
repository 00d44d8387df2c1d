"""What megatron-core needs to train on a CPU with gloo: test-harness shims only (never in the
library; issue 35 lists what a feasibility run found).

- ``torch.cuda.current_device`` / ``synchronize`` / ``get_rng_state`` / ``manual_seed`` that
  answer on a machine without CUDA (Megatron calls them unconditionally);
- a ``TorchFunctionMode`` that puts ``device="cuda"`` (or ``torch.cuda.current_device()``)
  tensors on the CPU;
- ``Tensor.type()`` answering ``torch.cuda.FloatTensor`` (and so on) for CPU tensors: Megatron's
  DDP sorts parameters into buffers by that name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_REAL_TYPE = torch.Tensor.type


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and (device == "cuda" or isinstance(device, int) or (
                isinstance(device, torch.device) and device.type == "cuda")
                or (isinstance(device, str) and device.startswith("cuda"))):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.cuda, torch.Tensor.to) and args:
            if func is torch.Tensor.cuda:
                return args[0]
            args = tuple("cpu" if (a == "cuda" or (isinstance(a, torch.device)
                                   and a.type == "cuda")) else a for a in args)
        return func(*args, **kwargs)


def _type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs:
        return _REAL_TYPE(self, *args, **kwargs)
    name = _REAL_TYPE(self)
    # (under the mode below this runs twice: once through __torch_function__)
    return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)


def install() -> None:
    """Megatron on a CPU: call once, before building anything of Megatron's."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)  # type: ignore[assignment]
    torch.Tensor.type = _type  # type: ignore[method-assign, assignment]
    _CudaToCpu().__enter__()

"""CPU-only shims for running torchtitan 0.3.0's own models and Trainer, and Accelerate's FSDP,
on the CPU tests: kept in the tests, never in ciuic (docs/integrations.md lists them).

- ``triton``: torchtitan's model packages import three modules that import triton at the top
  (its expert-parallel kernels and two fused overrides), and triton has no CPU wheel. The
  model packages are imported against a stub, which is then taken away: torch (which has
  found triton absent before) and everything imported later see no triton. A kernel of
  theirs would fail if it were called; the CPU tests call none.
- Accelerate's FSDP (:func:`accelerate_fsdp_on_cpu`): accelerate 1.16 makes a run FSDP only on
  an accelerator device (``AcceleratorState`` lists ``MULTI_GPU``, ``MULTI_XPU``, ...); on the
  CPU it stays ``MULTI_CPU`` and ``prepare`` wraps the model in DDP, ignoring the plugin without
  a word. The shim sets the distributed type after the ``Accelerator`` is built; from there on
  ``prepare`` (``fully_shard`` or ``FullyShardedDataParallel``), ``accumulate``, ``save_state``
  and ``load_state`` are accelerate's own FSDP code, run on gloo.

And one that is not CPU-only (:func:`torch_213_for_torchtitan`): torchtitan 0.3.0 (the newest
release) calls ``torch.distributed.set_timeout`` after a job's first step, which torch 2.13 (the
pinned one) no longer has; the same call on a GPU fails the same way.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

NEEDS_TRITON = ("torchtitan.distributed.minimal_async_ep.kernels",
                "torchtitan.overrides.fused_mla", "torchtitan.overrides.fused_swiglu",
                "torchtitan.models.llama3")

#: torch's modules that import triton themselves (once, when first imported)
BEFORE = ("torch._inductor.runtime.triton_compat", "torch._inductor.ir")


class _Anything:
    """Stands for any triton name at import time: callable, subscriptable, an attribute of
    itself (``tl.pointer_type(tl.int64)``, ``@triton.jit(do_not_specialize=...)``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # a bare decorator
        return self

    def __getattr__(self, name: str) -> _Anything:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __getitem__(self, key: Any) -> _Anything:
        return self


def _stub(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    anything = _Anything()

    def attribute(attr: str) -> Any:
        if attr == "__version__":  # torch's modules ask it in a try/except ImportError
            raise ImportError("triton is a stub here (tests/helpers/cpu_shims.py)")
        if attr.startswith("__"):
            raise AttributeError(attr)
        return anything

    module.__getattr__ = attribute  # type: ignore[method-assign]
    return module


def import_torchtitan_without_triton() -> None:
    """Import the torchtitan modules that need triton, where triton is not installed."""
    if importlib.util.find_spec("triton") is not None:
        return
    # torch finds triton absent first, for good: the modules that import it themselves, and
    # the answer it remembers (functools.cache) for the others
    for name in BEFORE:
        importlib.import_module(name)
    from torch.utils._triton import has_triton, has_triton_package

    assert not has_triton_package() and not has_triton()

    stubs = {"triton": _stub("triton"), "triton.language": _stub("triton.language")}
    stubs["triton"].language = stubs["triton.language"]  # type: ignore[attr-defined]
    sys.modules.update(stubs)
    try:
        for name in NEEDS_TRITON:
            importlib.import_module(name)
    finally:
        for name in stubs:
            del sys.modules[name]


def torch_213_for_torchtitan() -> None:
    """``torch.distributed.set_timeout(timeout, group)``, which torchtitan 0.3.0's
    ``set_pg_timeouts`` calls and torch 2.13 no longer has: the same through
    ``distributed_c10d._set_pg_timeout`` (the default group for None)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]


def torchtitan_on_cpu() -> None:
    """torchtitan 0.3.0 takes CUDA when torch finds no accelerator (``tools.utils.
    get_device_info``): its device is the CPU here, set before any module of its that copies
    it (``from torchtitan.tools.utils import device_type``) is imported, with what its memory
    monitor asks of a device module (the machine's memory as the capacity, no peak
    statistics)."""
    import os

    import torch
    from torchtitan.tools import utils

    cpu = types.ModuleType("torchtitan_cpu_device")
    for name in ("set_device", "synchronize", "device_count", "Stream",
                 "stream", "current_stream", "is_available"):
        setattr(cpu, name, getattr(torch.cpu, name))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu.current_device = lambda: 0  # type: ignore[attr-defined]  # (a barrier's device_ids)
    cpu.get_device_name = lambda device=None: "cpu"  # type: ignore[attr-defined]
    cpu.get_device_properties = (  # type: ignore[attr-defined]
        lambda device=None: types.SimpleNamespace(name="cpu", total_memory=memory))
    cpu.memory_stats = lambda device=None: {}  # type: ignore[attr-defined]
    cpu.reset_peak_memory_stats = lambda device=None: None  # type: ignore[attr-defined]
    cpu.empty_cache = lambda: None  # type: ignore[attr-defined]
    utils.device_type, utils.device_module = "cpu", cpu


def accelerate_fsdp_on_cpu(accelerator: Any, plugin: Any) -> None:
    """Make a CPU ``Accelerator`` (``cpu=True``, under torchrun) an FSDP one with ``plugin``,
    before anything is prepared. Both shared states are set: each new ``AcceleratorState``
    (accelerate builds some while preparing) copies ``PartialState``'s distributed type. FSDP1
    also gets the device ``cpu`` rather than ``MULTI_CPU``'s ``cpu:0``: it passes the device as
    ``device_id``, which ``FullyShardedDataParallel`` compares with its compute device."""
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.MULTI_CPU or accelerator._models:
        raise RuntimeError("accelerate_fsdp_on_cpu: build Accelerator(cpu=True) under torchrun "
                           "and call this before accelerator.prepare")
    for state in (PartialState._shared_state, accelerator.state.__dict__):
        state["distributed_type"] = DistributedType.FSDP
        if plugin.fsdp_version == 1:
            state["device"] = torch.device("cpu")
    accelerator.state.fsdp_plugin = plugin

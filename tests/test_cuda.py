"""The CUDA paths: pinned staging on a side stream, overlapped mode, restore to the device.

Skipped without a GPU (CI has none); run on a lent GPU with ``scripts/device_check.sh``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from ciuic import SnapshotManager, StateHolder, knobs
from ciuic.engine import staging
from ciuic.format.crypto import ObjectCodec
from tests.helpers.gpu import needs_cuda

pytestmark = needs_cuda()


# not tests/models.py's: on the GPU, with a GELU and Adam that may be capturable
def setup(width: int = 1024, capturable: bool = False
          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 8)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=capturable)
    train_step(model, opt)
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(64, model[0].in_features, device="cuda")
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = list(model.state_dict().values()) + [
        v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def snapshot_of(m: SnapshotManager, width: int = 1024) -> dict[str, torch.Tensor]:
    """The latest snapshot's model, restored into a fresh CUDA model."""
    fresh, fresh_opt = setup(width)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    m.restore(fresh, fresh_opt)
    return {k: v.detach().clone() for k, v in fresh.state_dict().items()}


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_staging_buffers_are_pinned_exact_and_allocated_before_the_first_snapshot(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    # 1100 x 1100 fp32 = 4.84 MB: a power-of-two allocator would hold 8.39 MB (1.73x)
    model, opt = setup(width=1100)
    need = state_bytes(model, opt)
    caplog.set_level(logging.WARNING, logger="ciuic")
    with SnapshotManager("p", job="pinned", store=store_dir, save_interval=2) as m:
        before = rss_bytes()
        assert not m.step(1, model, opt)  # reserves the pinned buffers in the background
        m.wait()
        grown = rss_bytes() - before
        buffers = dict(m._pipeline.staging._buffers)
        assert buffers and all(b.is_pinned() for b in buffers.values())
        assert not staging._register_failed, caplog.text
        # page-locked pages are resident: RSS sees what was really allocated
        assert need <= grown <= 1.25 * need + (16 << 20), (grown, need)
        ptrs = {p: b.data_ptr() for p, b in buffers.items()}
        assert m.step(2, model, opt)
        m.wait()
        assert {p: b.data_ptr() for p, b in m._pipeline.staging._buffers.items()} == ptrs
        assert m.stats.failures == 0
        got = snapshot_of(m, width=1100)
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v), k


def test_a_failed_registration_leaves_no_cuda_error_for_the_training_thread() -> None:
    buf = staging.allocate_host(1 << 20, pin=0)
    assert buf.is_pinned()
    # registering the same pages again fails for real (cudaErrorHostMemoryAlreadyRegistered),
    # on ciuic's pin thread: the training thread's next kernel launch must not see that error
    err = staging._pin_thread.run(staging._register, buf.data_ptr(), 4096, 0)
    assert err != 0
    assert torch.ones(1000, device="cuda").sum().item() == 1000.0
    torch.cuda.synchronize()


def test_registration_failure_falls_back_to_pinned_memory_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(staging, "_register", lambda ptr, size, device: 101)  # invalid device
    monkeypatch.setattr(staging, "_register_failed", False)
    caplog.set_level(logging.WARNING, logger="ciuic")
    buf = staging.allocate_host(3 << 20, pin=0)
    assert buf.is_pinned() and buf.numel() == 3 << 20
    assert "cudaHostRegister" in caplog.text and staging._register_failed


@pytest.mark.parametrize("capturable", [False, True], ids=["step-on-cpu", "step-on-gpu"])
def test_snapshot_holds_the_values_of_the_call_on_cuda(store_dir: Path, capturable: bool
                                                       ) -> None:
    model, opt = setup(capturable=capturable)
    cpu_extra = {"ema": torch.arange(4096.0)}  # a CPU-resident tensor beside the GPU state
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    want_steps = [float(st["step"]) for st in opt.state.values()]
    want_moments = [st["exp_avg"].clone() for st in opt.state.values()]
    with SnapshotManager("p", job="moment", store=store_dir, save_interval=1) as m:
        assert m.step(0, model, opt, ema=StateHolder(cpu_extra))
        for _ in range(5):  # training changes everything at once, on the default stream
            train_step(model, opt)
        cpu_extra["ema"].zero_()
        m.wait()
        assert m.stats.failures == 0
        fresh, fresh_opt = setup(capturable=capturable)
        holder = StateHolder({})
        assert m.restore(fresh, fresh_opt, ema=holder) == 0
    for k, v in fresh.state_dict().items():
        assert v.is_cuda and torch.equal(v, want[k]), k
    assert [float(st["step"]) for st in fresh_opt.state.values()] == want_steps
    for st, moment in zip(fresh_opt.state.values(), want_moments, strict=True):
        assert st["exp_avg"].is_cuda and torch.equal(st["exp_avg"], moment)
    assert torch.equal(holder.state["ema"], torch.arange(4096.0))


def test_overlapped_mode_copies_during_the_next_step_and_holds_the_call_values(
        store_dir: Path) -> None:
    model, opt = setup(width=2048)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with SnapshotManager("p", job="overlap", store=store_dir, save_interval=1,
                         overlap=True) as m:
        assert m.step(0, model, opt)
        train_step(model, opt)  # forward/backward overlap the copy; the optimizer waits
        train_step(model, opt)
        m.wait()
        assert m.stats.failures == 0
        got = snapshot_of(m, width=2048)
    for k, v in got.items():
        assert torch.equal(v, want[k]), k


def test_restore_to_the_device_is_bit_exact_and_resumes_the_cuda_rng(store_dir: Path) -> None:
    model, opt = setup()
    with SnapshotManager("p", job="resume", store=store_dir, save_interval=1) as m:
        m.step(3, model, opt)
        m.wait()
        after = torch.randn(16, device="cuda")
        torch.randn(1000, device="cuda")  # move the generator on
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = setup()
    held = {id(v): v.data_ptr() for st in fresh_opt.state.values() for v in st.values()
            if v.is_cuda and v.numel() > 64}
    state_bytes = sum(v.numel() * v.element_size() for st in fresh_opt.state.values()
                      for v in st.values())
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with SnapshotManager("p", job="resume", store=store_dir, save_interval=1) as m:
        assert m.restore(fresh, fresh_opt) == 3
        # the optimizer keeps its own device tensors: copied into, not allocated again
        assert {id(v): v.data_ptr() for st in fresh_opt.state.values() for v in st.values()
                if v.is_cuda and v.numel() > 64} == held
        assert torch.cuda.max_memory_allocated() - before < state_bytes / 2
        assert torch.equal(torch.randn(16, device="cuda"), after)
        # the model was read into pinned staging buffers, which the next snapshot reuses
        lent = {p: b.data_ptr() for p, b in m._pipeline.staging._buffers.items()}
        assert lent and all(b.is_pinned() for b in m._pipeline.staging._buffers.values())
        m.step(4, fresh, fresh_opt)
        m.wait()
        assert all(m._pipeline.staging._buffers[p].data_ptr() == ptr for p, ptr in lent.items())
    for k, v in fresh.state_dict().items():
        assert v.is_cuda and torch.equal(v, want[k]), k
    for a, b in zip(opt.state.values(), fresh_opt.state.values(), strict=True):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_bf16_and_fp32_state_round_trips_with_compression(store_dir: Path) -> None:
    torch.manual_seed(1)
    state = {"w_bf16": (torch.randn(1024, 1024, device="cuda") * 0.02).bfloat16(),
             "master": torch.randn(1024, 1024, device="cuda") * 0.02,
             "exp_avg_sq": torch.rand(1024, 1024, device="cuda") * 1e-6}
    want = {k: v.clone() for k, v in state.items()}
    with SnapshotManager("p", job="codec", store=store_dir, save_interval=1,
                         compression="on") as m:
        m.step(0, state=StateHolder(state))
        for v in state.values():
            v.zero_()
        m.wait()
        assert m.stats.failures == 0
        stored = sum(f.stat().st_size for f in (store_dir / "objects" / "chunks").rglob("*")
                     if f.is_file())
        assert stored < 0.9 * sum(v.numel() * v.element_size() for v in want.values())
        holder = StateHolder({})
        m.restore(state=holder)
    for k, v in want.items():
        assert torch.equal(holder.state[k].to(v.device), v), k


def test_device_and_host_memory_stay_flat_across_50_snapshots(store_dir: Path) -> None:
    model, opt = setup()
    with SnapshotManager("p", job="flat", store=store_dir, save_interval=1, keep_last=2) as m:
        samples = []
        for s in range(50):
            train_step(model, opt)
            m.step(s, model, opt)
            if s in (9, 49):
                m.wait()
                torch.cuda.synchronize()
                samples.append((torch.cuda.memory_allocated(), rss_bytes()))
        m.wait()
        assert m.stats.snapshots == 50 and m.stats.failures == 0
    assert samples[0][0] == samples[1][0]  # device memory
    grown = samples[1][1] - samples[0][1]
    assert grown < 0.5 * state_bytes(model, opt), f"RSS grew {grown / 2**20:.1f} MiB"


def test_cpu_tensors_beside_cuda_ones_are_compared_and_cuda_ones_copied(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed state: the CPU tensor's staging buffer is pinned (the state has CUDA tensors);
    its unchanged chunks keep their digests, the CUDA tensor is copied and hashed each time,
    and both restore bit-exactly."""
    chunk = 64 * 1024
    hashed: list[int] = []
    name = ObjectCodec.name

    def counting(self: ObjectCodec, data: object) -> str:
        if len(memoryview(data)) == chunk:  # type: ignore[arg-type]
            hashed.append(1)
        return name(self, data)  # type: ignore[arg-type]

    monkeypatch.setattr(ObjectCodec, "name", counting)
    live = {"gpu": torch.randn(4 * chunk // 4, device="cuda"),
            "cpu": torch.randn(4 * chunk // 4)}
    with knobs.override(chunk_bytes=chunk), SnapshotManager(
            "p", job="mixed", store=store_dir, compression="off") as m:
        m.save(1, state=StateHolder(live))
        assert m._pipeline.staging._pinned >= {"state/gpu", "state/cpu"}
        hashed.clear()
        live["cpu"][-1] += 1.0  # the CPU tensor's last chunk; the GPU tensor unchanged
        m.save(2, state=StateHolder(live))
        assert len(hashed) == 1 + 4  # that chunk, and every chunk of the CUDA tensor
        got = StateHolder({})
        m.restore(state=got)
    assert torch.equal(got.state["cpu"], live["cpu"])
    assert torch.equal(got.state["gpu"].cpu(), live["gpu"].cpu())

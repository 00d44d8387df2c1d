"""One rank of the cold restart on the Ceph cluster (``bench/cluster_ranks.py``; torchrun,
gloo, CPU): FSDP2 over every rank, a state of ``--mib`` MiB in all (weights and AdamW's two
moments, fp32).

    torchrun --nproc-per-node W bench/cluster_ranks_worker.py --phase save|restore \
        --endpoint URL --ciuic BUCKET ... --boto3 BUCKET ... --mib 256 --out DIR

Per round (one bucket per system and round; the systems' order alternates by round), every
rank waits at a barrier, then:

- ``save``: ciuic's synchronous ``save()`` (committed: every object acknowledged by radosgw),
  and, as DCP writes a checkpoint, one object per rank with boto3 (``upload_fileobj``,
  ``TransferConfig``'s defaults: multipart above 8 MiB, 10 threads) of the rank's bytes: its
  local shards, concatenated;
- ``restore`` (a new torchrun: cold processes, no host memory): ciuic's ``restore()`` into the
  model and optimizer, and boto3's ``download_fileobj`` of the rank's object into memory, then
  copied into the local shards. Both are checked against the saving rank's digest.

Each rank's wall time (the call, barrier to barrier: the slowest rank's is the job's), its CPU
time (user and system, every thread) and the S3 requests it made (botocore's operations,
counted where they are sent) go to ``OUT/<phase>-rank<r>.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import blake3
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.leave import leave  # how a torchrun job script ends

REQUESTS: dict[str, int] = {}
LOCK = threading.Lock()


def count_requests() -> None:
    """Count every request botocore sends, by operation (PutObject, UploadPart, GetObject...),
    in this process (ciuic's S3 store and boto3's transfers alike)."""
    from botocore.endpoint import Endpoint

    send = Endpoint.make_request

    def count(operation_model: Any) -> None:
        with LOCK:
            REQUESTS[operation_model.name] = REQUESTS.get(operation_model.name, 0) + 1

    def counted(self: Any, operation_model: Any, request_dict: Any) -> Any:
        count(operation_model)
        return send(self, operation_model, request_dict)

    Endpoint.make_request = counted
    try:  # s3fs's client (DCP's fsspec storage): aiobotocore's endpoint sends its own way
        from aiobotocore.endpoint import AioEndpoint
    except ImportError:
        return
    asend = AioEndpoint.make_request

    async def acounted(self: Any, operation_model: Any, request_dict: Any) -> Any:
        count(operation_model)
        return await asend(self, operation_model, request_dict)

    AioEndpoint.make_request = acounted


def build(mib: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    cols, layers = 1024, 16
    rows = max(world, mib * 2**20 // (3 * 4 * cols * layers))  # weights + 2 moments, fp32
    model = nn.Sequential(*(nn.Linear(cols, rows if i % 2 == 0 else cols, bias=False)
                            if i % 2 == 0 else nn.Linear(rows, cols, bias=False)
                            for i in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, cols)).sum().backward()
    opt.step()  # the optimizer's moments exist
    opt.zero_grad(set_to_none=True)
    return model, opt


def local_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards of every tensor of the state, in a fixed order."""
    out = []
    for p in model.parameters():
        out.append(p.to_local().detach())  # type: ignore[attr-defined]
        for k in ("exp_avg", "exp_avg_sq"):
            out.append(opt.state[p][k].to_local().detach())
    return out


def digest(tensors: list[torch.Tensor]) -> str:
    h = blake3.blake3()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


CPU: dict[str, list[float]] = {}


def timed(fn: Any, system: str) -> float:
    """The call's wall time, barrier to barrier; its CPU time (every thread of this process,
    user and system) goes to ``CPU[system]``."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    c1 = time.process_time()
    dist.barrier()
    CPU[system].append(c1 - c0)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["save", "restore"], required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--ciuic", nargs="+", required=True, help="a bucket per round")
    p.add_argument("--boto3", nargs="+", required=True, help="a bucket per round")
    p.add_argument("--dcp", nargs="+", default=None,
                   help="a bucket per round: DCP's own save and load through its fsspec "
                        "storage (s3fs) too")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--also", default=None, metavar="KNOB=VALUE",
                   help="restore: ciuic a second time each round with this knob (an A/B in "
                        "one run, as the system 'ciuic KNOB=VALUE')")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import boto3
    from boto3.s3.transfer import TransferConfig

    from ciuic import SnapshotManager, knobs

    count_requests()
    model, opt = build(a.mib, world)
    client = boto3.client("s3", endpoint_url=a.endpoint, region_name="us-east-1")
    key = f"rank{rank}.bin"
    systems = ["ciuic", "boto3"] + (["dcp"] if a.dcp else [])
    changes: dict[str, object] = {}
    if a.also and a.phase == "restore":
        name, _, value = a.also.partition("=")
        kind = type(getattr(knobs.get(), name))
        changes = {name: value.lower() in ("1", "true", "on") if kind is bool else kind(value)}
        systems.append(f"ciuic {a.also}")
    times: dict[str, list[float]] = {s: [] for s in systems}
    requests: dict[str, dict[str, int]] = {s: {} for s in systems}
    CPU.update({s: [] for s in systems})
    expect = None if a.phase == "save" else json.loads(
        (a.out / f"save-rank{rank}.json").read_text())["digest"]

    def ciuic(bucket: str, system: str = "ciuic") -> None:
        with knobs.override(**(changes if system != "ciuic" else {})):
            _ciuic(bucket, system)

    def _ciuic(bucket: str, system: str) -> None:
        url = f"s3://{bucket}/bench?endpoint={a.endpoint}"
        os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()  # nothing cached from a round before
        m = SnapshotManager("bench", job="cold", store=url, asynchronous=False,
                            handle_signals=False)
        if a.phase == "save":
            times[system].append(timed(lambda: m.save(1, model, opt), system))
        else:
            for t in local_tensors(model, opt):
                t.zero_()
            if os.environ.get("BENCH_PROFILE") and rank == 0:  # where a restore's time goes
                import cProfile

                prof = cProfile.Profile()
                times[system].append(timed(lambda: prof.runcall(m.restore, model, opt),
                                           system))
                prof.dump_stats(str(a.out / f"restore-{bucket}-{len(times[system])}.prof"))
            else:
                times[system].append(timed(lambda: m.restore(model, opt), system))
            # (the optimizer's state may be new tensors: DCP's set_state_dict)
            assert digest(local_tensors(model, opt)) == expect, \
                f"rank {rank}: ciuic's restore differs"
        m.close()

    def plain(bucket: str) -> None:
        mine = local_tensors(model, opt)
        if a.phase == "save":
            def up() -> None:
                payload = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                   for t in mine)
                client.upload_fileobj(io.BytesIO(payload), bucket, key, Config=TransferConfig())
            times["boto3"].append(timed(up, "boto3"))
        else:
            def down() -> None:
                buf = io.BytesIO()
                client.download_fileobj(bucket, key, buf, Config=TransferConfig())
                data = memoryview(buf.getbuffer())
                at = 0
                for t in mine:
                    n = t.numel() * t.element_size()
                    t.view(-1).view(torch.uint8).copy_(torch.frombuffer(data[at:at + n],
                                                                        dtype=torch.uint8))
                    at += n
            for t in mine:
                t.zero_()
            times["boto3"].append(timed(down, "boto3"))
            assert digest(mine) == expect, f"rank {rank}: boto3's restore differs"

    def dcp(bucket: str) -> None:
        """DCP's own save or load, as torchtitan's checkpointer makes them (the state dict of
        ``get_state_dict``; on load ``set_state_dict`` into the model and optimizer), through
        DCP's fsspec storage on s3fs."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        url, opts = f"s3://{bucket}/ckpt", {"client_kwargs": {"endpoint_url": a.endpoint}}

        def state() -> dict[str, Any]:
            msd, osd = get_state_dict(model, opt)
            return {"model": msd, "optim": osd}

        if a.phase == "save":
            times["dcp"].append(timed(lambda: dcp.save(
                state(), storage_writer=FsspecWriter(url, **opts)), "dcp"))
            return

        def load() -> None:
            sd = state()
            dcp.load(sd, storage_reader=FsspecReader(url, **opts))
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        for t in local_tensors(model, opt):
            t.zero_()
        times["dcp"].append(timed(load, "dcp"))
        assert digest(local_tensors(model, opt)) == expect, f"rank {rank}: DCP's load differs"

    for r, (cb, bb) in enumerate(zip(a.ciuic, a.boto3, strict=True)):
        for system in systems[r % len(systems):] + systems[:r % len(systems)]:
            before = dict(REQUESTS)
            if system == "boto3":
                plain(bb)
            elif system == "dcp":
                dcp(a.dcp[r])
            else:
                ciuic(cb, system)
            if r == 0:
                requests[system] = {k: v - before.get(k, 0) for k, v in REQUESTS.items()
                                    if v - before.get(k, 0)}
    a.out.mkdir(parents=True, exist_ok=True)
    last = local_tensors(model, opt)
    (a.out / f"{a.phase}-rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world": world, "times": times, "cpu": CPU, "requests": requests,
        "bytes": sum(t.numel() * t.element_size() for t in last), "digest": digest(last)}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave(0)  # not a return to the interpreter: see tests/helpers/leave.py

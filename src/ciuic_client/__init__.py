"""The seed's client: ``CiuicClient(api_key, endpoint)`` against a ciuic server.

    from ciuic_client import CiuicClient
    client = CiuicClient(api_key="ciuic_...", endpoint="https://ciuic.example.com")
    client.save_snapshot({"model_state_dict": model.state_dict(), "epoch": 3, "loss": 0.41})
    latest = client.get_latest_snapshot()   # {"id", "step", "created", "data"}

A thin layer over the library: snapshots are written exactly as ``SnapshotManager`` writes
them (content-addressed chunks, only the missing ones sent; with ``encryption=True`` sealed on
the client), into the key's project and that project's ``default`` job unless told otherwise.
Every top-level entry of the saved dict is one state; numbers among them are also recorded as
metrics. Loading never unpickles: tensors come back as tensors, plain values as themselves.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ciuic.chain.health import HealthTracker
from ciuic.chain.repo import Repository, cached_catalog_url
from ciuic.chain.writer import ChunkCache, SnapshotWrite, write_snapshot
from ciuic.engine.compression import CompressionPolicy
from ciuic.errors import ConfigurationError, SnapshotNotFound
from ciuic.format.crypto import ObjectCodec
from ciuic.format.info import SnapshotInfo
from ciuic.format.tree import Leaf, encode
from ciuic.restore.reader import load_states
from ciuic.state.capture import Captured
from ciuic.store.http import HttpStore

__all__ = ["CiuicClient"]


class CiuicClient:
    """A connection to a ciuic server for one project and job.

    Args:
        api_key: the key (``ciuic apikey create``); default ``$CIUIC_API_KEY``.
        endpoint: the server, e.g. ``"https://ciuic.example.com"``; default ``$CIUIC_ENDPOINT``.
        project: default: the key's project.
        job: default ``"default"``.
        encryption: seal every object on the client (key from ``CIUIC_ENCRYPTION_KEY``).
    """

    def __init__(self, api_key: str | None = None, endpoint: str | None = None, *,
                 project: str | None = None, job: str = "default",
                 encryption: bool = False) -> None:
        endpoint = endpoint or os.environ.get("CIUIC_ENDPOINT")
        if not endpoint:
            raise ConfigurationError("no server: pass endpoint='https://...' or set "
                                     "CIUIC_ENDPOINT")
        api_key = api_key or os.environ.get("CIUIC_API_KEY")
        if project is None:
            project = str(HttpStore(endpoint, "-", api_key).whoami()["project"])
        self.project, self.job = project, job
        self._store = HttpStore(endpoint, project, api_key)
        self._repo = Repository.open(self._store, cached_catalog_url(self._store.url))
        self._codec = ObjectCodec(self._repo.keyring if encryption else None)
        self._compression = CompressionPolicy("auto", self._store.write_speed,
                                              self._store.read_speed)
        self._cache = ChunkCache()
        self._health = HealthTracker()

    def save_snapshot(self, data: Mapping[str, Any], step: int | None = None
                      ) -> dict[str, Any]:
        """Save ``data`` (a dict of state dicts, tensors and plain values) as the job's next
        snapshot. ``step``: default ``data["step"]`` or ``data["epoch"]`` when an integer, else
        the previous snapshot's step + 1. Returns ``{"id", "step", "created"}``."""
        if not isinstance(data, Mapping) or not data:
            raise ConfigurationError("save_snapshot() takes a non-empty dict, e.g. "
                                     "{'model_state_dict': model.state_dict(), 'epoch': 3}")
        latest = self._latest()
        if step is None:
            for name in ("step", "epoch"):
                if isinstance(data.get(name), int) and not isinstance(data.get(name), bool):
                    step = int(data[name])
                    break
            else:
                step = latest.step + 1 if latest is not None else 0
        leaves: list[Leaf] = []
        states = {str(k): encode(v, str(k), leaves) for k, v in data.items()}
        metrics = {str(k): v for k, v in data.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        m, sid = write_snapshot(
            SnapshotWrite(self._repo, self.project, self.job, step,
                          latest.id if latest is not None else "", self._cache,
                          codec=self._codec, compression=self._compression, health=self._health),
            Captured(states=states, leaves=leaves, metrics=metrics))
        return {"id": sid, "step": m.step, "created": m.created}

    def get_latest_snapshot(self) -> dict[str, Any]:
        """The newest snapshot of the job: ``{"id", "step", "created", "data"}``. Raises
        :class:`~ciuic.errors.SnapshotNotFound` when there is none."""
        latest = self._latest()
        if latest is None:
            raise SnapshotNotFound(f"job {self.project}/{self.job} has no snapshot yet")
        return self._load(latest)

    def get_snapshot(self, snapshot_id: str) -> dict[str, Any]:
        """One snapshot by ID (or unique prefix, or ``JOB@STEP``)."""
        return self._load(self._repo.resolve(snapshot_id))

    def list_snapshots(self) -> list[dict[str, Any]]:
        """The job's snapshots, newest first (without their data)."""
        self._repo.sync_job(self.project, self.job)
        return [{"id": s.id, "step": s.step, "created": s.created, "metrics": s.metrics}
                for s in self._repo.catalog.snapshots(self.project, self.job,
                                                      newest_first=True)]

    def close(self) -> None:
        self._repo.close()

    def __enter__(self) -> CiuicClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _latest(self) -> SnapshotInfo | None:
        self._repo.sync_job(self.project, self.job)
        return self._repo.catalog.latest(self.project, self.job)

    def _load(self, info: SnapshotInfo) -> dict[str, Any]:
        _, data = load_states(self._repo, info)
        return {"id": info.id, "step": info.step, "created": info.created, "data": data}

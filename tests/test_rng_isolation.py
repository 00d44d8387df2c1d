"""Nothing ciuic or its dependencies do in the background draws from the training's random
number generators (Python's ``random``, NumPy's legacy global, torch's CPU generator): a store
fault, retried behind the training's back, must not change what training computes (issue 42).

Audited (docs/reliability.md): botocore's retries (their jitter drew from ``random``: now a
generator of the store's own), ciuic's own retries (no jitter), compression, the catalog
(SQLAlchemy draws only for two-phase transactions, psycopg only with
``load_balance_hosts=random``: ciuic uses neither), the server client, the peer service
(``secrets``/``os.urandom``), temporary names (``tempfile`` keeps its own generator)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ciuic import SnapshotManager, knobs
from tests.models import model_opt
from tests.s3server import make_bucket, moto_process, stop
from tests.serverutil import new_key, serving


def _seed() -> None:
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)


def _rngs() -> tuple[Any, ...]:
    """Every RNG's state, comparable with ``==``: (Python, NumPy, torch CPU, CUDA)."""
    state = np.random.get_state(legacy=True)
    assert isinstance(state, tuple)
    cuda = ([s.tolist() for s in torch.cuda.get_rng_state_all()]
            if torch.cuda.is_available() else [])
    return (random.getstate(), (state[0], state[1].tolist(), *state[2:]),
            torch.get_rng_state().tolist(), cuda)


def _run(fault: Callable[[], object] | None = None, **options: Any) -> tuple[Any, Any]:
    """Seed, snapshot step 1, apply ``fault``, snapshot step 2 and wait for it (after its
    retries, it fails where the store is down): the RNGs' states just after seeding and after
    the wait."""
    model, opt = model_opt(4, 4, seed=0)
    with knobs.override(store_attempts=2, store_backoff_s=0.01, s3_connect_timeout_s=1.0):
        m = SnapshotManager("p", job="j", save_interval=1, handle_signals=False, **options)
        try:
            _seed()
            seeded = _rngs()
            m.step(1, model, opt)
            m.wait()
            assert m.stats.failures == 0
            if fault is not None:
                fault()
            m.step(2, model, opt)
            m.wait()
            assert m.stats.failures == (0 if fault is None else 1), m.stats.last_error
            after = _rngs()
        finally:
            m.close()
    return seeded, after


def _same(faulted: tuple[Any, ...], healthy: tuple[Any, ...]) -> None:
    for name, a, b in zip(("Python", "NumPy", "torch", "CUDA"), faulted, healthy, strict=True):
        assert a == b, f"the {name} RNG advanced in the background"


def test_an_s3_outage_leaves_every_rng_as_a_healthy_run_does(tmp_path: Path,
                                                             s3_endpoint: str) -> None:
    """The issue's reproduction: botocore drew its retry jitter from the global ``random``,
    15 numbers for one snapshot written while the S3 server was down."""
    seeded, healthy = _run(store=f"s3://{make_bucket(s3_endpoint)}/c?endpoint={s3_endpoint}")
    _same(healthy, seeded)
    with moto_process(tmp_path / "moto.log") as (endpoint, proc):
        _, faulted = _run(lambda: stop(proc),
                          store=f"s3://{make_bucket(endpoint)}/c?endpoint={endpoint}")
    _same(faulted, healthy)


def test_a_server_outage_leaves_every_rng_untouched(tmp_path: Path) -> None:
    """The server client's retries, against a `ciuic serve` stopped between two snapshots."""
    store = tmp_path / "store"
    key = new_key(store, "p", "writer")
    with serving(store, tmp_path / "server.log") as (url, proc):
        seeded, after = _run(lambda: stop(proc), endpoint=url, api_key=key)
    _same(after, seeded)


@pytest.mark.parametrize("compression", ["on", "off"])
def test_a_healthy_snapshot_leaves_every_rng_untouched(tmp_path: Path, compression: str) -> None:
    """Staging, compression, hashing, the catalog, the writer thread: nothing draws."""
    seeded, after = _run(store=tmp_path / "store", compression=compression)
    _same(after, seeded)


def test_botocores_other_draws_leave_the_global_rng_alone(s3_endpoint: str) -> None:
    """botocore draws from ``random`` at call time also in its legacy retry mode (a client a
    user passes) and in an EC2 instance role's credential refresh (one draw per fetch, in the
    writer thread, at a moment set by the clock): once an S3 store is open, neither touches
    the training's generator."""
    import boto3
    import botocore.retryhandler
    import botocore.utils
    from botocore.config import Config

    from ciuic.store.s3 import S3Store, private_jitter

    for mode in ("legacy", "standard", "adaptive"):  # each client's jitter is its own
        assert private_jitter(boto3.client("s3", endpoint_url=s3_endpoint,
                                           config=Config(retries={"mode": mode})))
    S3Store(f"s3://{make_bucket(s3_endpoint)}/c?endpoint={s3_endpoint}")
    _seed()
    seeded = _rngs()
    botocore.retryhandler.delay_exponential("rand", 2, 3)
    botocore.utils.InstanceMetadataFetcher()._evaluate_expiration(
        {"expiry_time": "2000-01-01T00:00:00Z"})
    _same(_rngs(), seeded)

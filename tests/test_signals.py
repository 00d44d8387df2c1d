"""SnapshotManager's signal handlers: managers closed in any order put back the handlers that
were there before them."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ciuic import SnapshotManager


def test_managers_closed_in_creation_order_leave_the_original_signal_handlers(
        store_dir: Path) -> None:
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever ran earlier
    try:
        m1 = SnapshotManager("p", job="a", store=store_dir)
        m2 = SnapshotManager("p", job="b", store=store_dir)
        m1.close()
        m2.close()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert not any(getattr(signal.getsignal(s), "__self__", None) in (m1, m2)
                       for s in (signal.SIGINT, signal.SIGTERM))
        # a closed manager's handler, still called by someone's chain, passes the signal on
        with pytest.raises(KeyboardInterrupt):
            m1._signals._on_signal(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, before)

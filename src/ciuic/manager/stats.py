"""``manager.stats``: what a manager has done, for the user and the benchmark."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ManagerStats:
    snapshots: int = 0
    failures: int = 0
    skipped: int = 0  # due while the previous snapshot was still being written (on_busy="skip")
    waited_s: float = 0.0  # training time spent waiting for a previous snapshot (on_busy="wait")
    last_stall_s: float = 0.0  # how long the last step()/save_async() blocked training
    consecutive_failures: int = 0
    bytes_total: int = 0
    bytes_new: int = 0  # new chunk bytes of the committed snapshots (every rank's)
    bytes_written: int = 0  # of those, the bytes this process wrote (multi-rank: its share)
    last_save_s: float = 0.0  # from the call until committed
    last_error: str = ""
    last_failed_step: int | None = None  # the step of the last snapshot that failed
    overlap_wait_s: float = 0.0  # optimizer steps held back until an overlapped copy finished
    last_staged_bytes: int = 0  # what the last snapshot copied into staging buffers
    #: save_interval="auto": the time between snapshots it chose, why, and the measured cost of
    #: a snapshot (stall plus in-run slowdown; None until the first one)
    interval_s: float | None = None
    interval_reason: str = ""
    snapshot_cost_s: float | None = None
    mtbf_s: float | None = None  # the job's mean time between failures, as estimated
    #: whether chunks are compressed, and why ("auto: raw (measured 0.61 s/GiB raw against
    #: 1.20 s/GiB compressed)"; "off (pinned)")
    compression: str = ""
    #: the last multi-rank restore of a body in parts (docs/format.md, body format 3): the
    #: parts this rank read, and how many the body has (the same layout: its own and rank 0's)
    restore_parts: tuple[int, int] = (0, 0)

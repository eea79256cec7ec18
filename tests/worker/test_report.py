"""A rank that reports a lost peer while the store's host is gone (the lost peer was on it): the
report is dropped quietly (the agent says the store is gone, in one line); it used to raise
out of the backend's failure handler and print a traceback into the job's log."""

from __future__ import annotations

from types import SimpleNamespace

import torch.distributed as dist

from tmrun.worker.recovery import Recovery


class GoneStore:
    def add(self, key: str, value: int) -> int:
        raise dist.DistNetworkError("Broken pipe")

    def set(self, key: str, value: bytes) -> None:
        raise dist.DistNetworkError("Broken pipe")


def test_a_report_to_a_store_that_is_gone_is_dropped_without_raising() -> None:
    recovery = Recovery.__new__(Recovery)
    recovery._ctx = SimpleNamespace(require_store=GoneStore, rank=1, gen=0)  # type: ignore[attr-defined]
    recovery._report(0, "PeerLostError: rank 0")  # must not raise

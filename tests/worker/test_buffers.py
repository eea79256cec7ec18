"""tmrun.worker.buffers: the persistent buffers of a step's start, put back after an aborted step."""

from __future__ import annotations

import torch

from tmrun.worker.buffers import BufferSnapshot, persistent_buffers, unsynchronised_buffers


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)  # a cache: not copied
        self.other = self.norm  # the same module twice: its buffers once


def test_batch_norm_statistics_go_back_to_the_steps_start() -> None:
    net = _Net()
    found = persistent_buffers(net)
    assert [b is net.norm.running_mean or b is net.norm.running_var or b is net.norm.num_batches_tracked
            for b in found] == [True, True, True]
    snapshot = BufferSnapshot()
    snapshot.take(found)
    before = [b.clone() for b in found]
    net.norm(torch.randn(8, 4))  # the aborted step's forward (in place, no version bump)
    assert not torch.equal(net.norm.running_mean, before[0])
    live = net.norm.running_mean
    assert snapshot.restore() == 3
    assert all(torch.equal(b, c) for b, c in zip(found, before))
    assert net.norm.running_mean is live  # in place: the module keeps its tensors


def test_the_copies_are_kept_from_step_to_step() -> None:
    net = _Net()
    snapshot = BufferSnapshot()
    snapshot.take(persistent_buffers(net))
    copies = [c for _, c in snapshot._pairs]
    net.norm(torch.randn(8, 4))  # a committed step
    snapshot.take(persistent_buffers(net))  # the next step's start: same tensors, new values
    assert all(a is b for a, b in zip([c for _, c in snapshot._pairs], copies))  # no new allocation
    net.norm(torch.randn(8, 4))
    snapshot.restore()
    assert snapshot.nbytes == 4 * 4 * 2 + 8


def test_buffers_no_collective_keeps_alike_are_named() -> None:
    net = _Net()
    assert unsynchronised_buffers([net]) == ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    assert unsynchronised_buffers([torch.nn.Linear(2, 2)]) == []

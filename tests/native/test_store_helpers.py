"""tmrun.comm.native: bootstrap through a torch Store, tensor views, replacement through the store."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist

from conftest import buf, close_all, dt, run_ranks, tn

native = pytest.importorskip("tmrun.comm.native")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stores():
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))

    def client():
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))

    yield client
    del master


def test_connect_via_store_and_torch_tensors(stores):
    n = 3
    comms = [None] * n

    def boot(r):
        comms[r] = native.connect_via_store(stores(), r, n, "storejob", epoch=0, timeout=5.0)

    run_ranks(list(range(n)), boot)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
            ts = [torch.full((1001,), r + 1, dtype=dtype) for r in range(n)]

            def body(c):
                b, dt = native.as_buffer(ts[c.rank])
                c.allreduce(b, dtype=dt)

            run_ranks(comms, body)
            for t in ts:
                assert torch.equal(t, torch.full((1001,), 6, dtype=dtype))
        with pytest.raises(ValueError):
            native.as_buffer(torch.zeros(4, 4).t())
        with pytest.raises(TypeError):
            native.as_buffer(torch.zeros(4, dtype=torch.int8))
    finally:
        close_all(comms)


def test_replacement_through_the_store(stores):
    n, victim = 4, 2
    comms = [None] * n

    def boot(r):
        comms[r] = native.connect_via_store(stores(), r, n, "storerep", epoch=0, timeout=5.0)

    run_ranks(list(range(n)), boot)
    joiner = [None]
    try:
        comms[victim].close()

        def step(r):
            if r == victim:
                joiner[0] = native.join_via_store(stores(), victim, n, "storerep", epoch=1, timeout=5.0)
            else:
                native.prepare_replacement(stores(), comms[r], [victim], 1)
                comms[r].commit()

        run_ranks(list(range(n)), step)
        comms[victim] = joiner[0]
        xs = [torch.full((10,), c.rank, dtype=torch.int32) for c in comms]
        run_ranks(comms, lambda c: c.allreduce(buf(xs[c.rank]), dtype=dt(xs[c.rank])))
        assert all((x == 6).all() for x in xs)
        assert all(c.epoch == 1 for c in comms)
    finally:
        close_all(comms)


def test_two_rank_replacement():
    from conftest import make_group

    comms = make_group(2, job="two")
    try:
        j = tn.Communicator(1, 2, "two", 1)
        comms[0].prepare([1], {1: j.address}, 1)
        comms[1].close()
        group = [comms[0], j]
        run_ranks(group, lambda c: c.commit() if c.rank == 0 else c.connect([comms[0].address, j.address]))
        comms = group
        x = [torch.ones(100000, dtype=torch.float32), torch.ones(100000, dtype=torch.float32)]
        run_ranks(comms, lambda c: c.allreduce(buf(x[c.rank]), dtype=dt(x[c.rank])))
        assert (x[0] == 2).all() and (x[1] == 2).all()
        assert comms[0].counters()["links_opened"] == 2
    finally:
        close_all(comms)


def test_non_neighbour_reaches_the_joiner_after_replacement(stores):
    """Rank 0 is not a ring neighbour of rank 2 (world 4): its point-to-point link to the joiner
    is dialled lazily, so it must know the joiner's new address (not the dead rank's old one).
    This is how a donor streams state to a joiner that is not its neighbour."""
    n, victim = 4, 2
    comms = [None] * n
    opts = {"timeout": 5.0, "connect_timeout": 3.0}

    def boot(r):
        comms[r] = native.connect_via_store(stores(), r, n, "farjoin", epoch=0, **opts)

    run_ranks(list(range(n)), boot)
    joiner = [None]
    try:
        assert victim not in comms[0].ring_peers
        comms[victim].close()

        def step(r):
            if r == victim:
                joiner[0] = native.join_via_store(stores(), victim, n, "farjoin", epoch=1, **opts)
            else:
                native.prepare_replacement(stores(), comms[r], [victim], 1)
                comms[r].commit()

        run_ranks(list(range(n)), step)
        comms[victim] = joiner[0]
        sent = torch.arange(64, dtype=torch.int64)
        got = torch.zeros(64, dtype=torch.int64)

        def p2p(c):
            if c.rank == 0:
                c.send(buf(sent), victim, 7)
            elif c.rank == victim:
                c.recv(buf(got), 0, 7)

        run_ranks(comms, p2p, timeout=20)
        assert torch.equal(sent, got)
    finally:
        close_all(comms)

"""Every collective x dtype x op against a reference computed here (torch), odd and empty sizes,
determinism, async operations. Ranks are threads of this process (the GIL is released)."""

from __future__ import annotations

import array

import pytest
import torch

from conftest import buf, close_all, dt, make_group, run_ranks, tn

DTYPES = {
    tn.DType.FLOAT32: torch.float32,
    tn.DType.FLOAT64: torch.float64,
    tn.DType.FLOAT16: torch.float16,
    tn.DType.BFLOAT16: torch.bfloat16,
    tn.DType.INT32: torch.int32,
    tn.DType.INT64: torch.int64,
    tn.DType.UINT8: torch.uint8,
}
OPS = [tn.ReduceOp.SUM, tn.ReduceOp.AVG, tn.ReduceOp.MIN, tn.ReduceOp.MAX, tn.ReduceOp.PRODUCT]
# Element counts: empty, tiny (< world size), odd, latency path, ring path (> small_bytes), not
# divisible by any world size used here.
SIZES = [0, 1, 2, 7, 1031, 40001]


def inputs(n: int, size: int, dt: torch.dtype, op, seed: int) -> list[torch.Tensor]:
    """Inputs whose reduction is exact in the dtype, so any order gives the same reference."""
    g = torch.Generator().manual_seed(seed)
    if op == tn.ReduceOp.PRODUCT:
        choices = torch.tensor([1, 2] if dt == torch.uint8 else [-1, 1, 2])
    elif dt == torch.uint8:
        choices = torch.arange(0, 60)
    else:
        choices = torch.arange(-8, 9)
    out = []
    for _ in range(n):
        idx = torch.randint(0, len(choices), (size,), generator=g)
        out.append(choices[idx].to(dt))
    return out


def reference(xs: list[torch.Tensor], op, n: int) -> torch.Tensor:
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in (tn.ReduceOp.SUM, tn.ReduceOp.AVG):
            acc = acc + x
        elif op == tn.ReduceOp.PRODUCT:
            acc = acc * x
        elif op == tn.ReduceOp.MIN:
            acc = torch.minimum(acc, x)
        else:
            acc = torch.maximum(acc, x)
    if op == tn.ReduceOp.AVG:
        if acc.dtype.is_floating_point:
            acc = (acc.float() / n).to(acc.dtype) if acc.dtype in (torch.float16, torch.bfloat16) else acc / n
        else:
            acc = torch.div(acc, n, rounding_mode="trunc")
    return acc


@pytest.fixture(scope="module", params=[2, 3, 4])
def group(request):
    # small_bytes low and segments small so that moderate sizes exercise the pipelined ring
    g = make_group(request.param, job=f"coll{request.param}", small_bytes=2048, segment_bytes=8192)
    yield g
    close_all(g)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: d.name)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_allreduce(group, dtype, op):
    n = len(group)
    tdt = DTYPES[dtype]
    for size in SIZES:
        xs = inputs(n, size, tdt, op, seed=size * 31 + n)
        expected = reference(xs, op, n)
        work = [x.clone() for x in xs]
        run_ranks(group, lambda c: c.allreduce(buf(work[c.rank]), op=op, dtype=dtype))
        for r in range(n):
            assert torch.equal(work[r], expected), (n, size, r, work[r][:8], expected[:8])


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: d.name)
def test_broadcast(group, dtype):
    n = len(group)
    tdt = DTYPES[dtype]
    for size in SIZES:
        for root in range(n):
            xs = inputs(n, size, tdt, tn.ReduceOp.SUM, seed=root + size)
            expected = xs[root].clone()
            run_ranks(group, lambda c: c.broadcast(buf(xs[c.rank]), root=root, dtype=dtype))
            for r in range(n):
                assert torch.equal(xs[r], expected)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: d.name)
def test_allgather(group, dtype):
    n = len(group)
    tdt = DTYPES[dtype]
    for size in SIZES:
        xs = inputs(n, size, tdt, tn.ReduceOp.SUM, seed=size)
        outs = [torch.zeros(n * size, dtype=tdt) for _ in range(n)]
        run_ranks(group, lambda c: c.allgather(buf(outs[c.rank]), buf(xs[c.rank]), dtype=dtype))
        expected = torch.cat(xs)
        for r in range(n):
            assert torch.equal(outs[r], expected)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: d.name)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_reduce_scatter(group, dtype, op):
    n = len(group)
    tdt = DTYPES[dtype]
    for size in (0, 1, 5, 3001):
        xs = inputs(n, size * n, tdt, op, seed=size + 7)
        expected = reference(xs, op, n)
        outs = [torch.zeros(size, dtype=tdt) for _ in range(n)]
        before = [x.clone() for x in xs]
        run_ranks(group, lambda c: c.reduce_scatter(buf(outs[c.rank]), buf(xs[c.rank]), op=op, dtype=dtype))
        for r in range(n):
            assert torch.equal(outs[r], expected[r * size:(r + 1) * size])
            assert torch.equal(xs[r], before[r]), "input must not be modified"


def test_barrier_and_counters(group):
    before = [c.counters()["collectives"] for c in group]
    for _ in range(5):
        run_ranks(group, lambda c: c.barrier())
    assert [c.counters()["collectives"] - b for c, b in zip(group, before)] == [5] * len(group)


@pytest.mark.parametrize("size", [0, 1, 4097, 300001])
def test_send_recv_all_pairs(group, size):
    """Point-to-point between every ordered pair (non-neighbours get a lazily opened link)."""
    n = len(group)
    for src in range(n):
        for dst in range(n):
            if src == dst:
                continue
            gen = torch.Generator().manual_seed(src * 10 + dst)
            payload = torch.randint(0, 255, (size,), dtype=torch.uint8, generator=gen)
            got = torch.zeros(size, dtype=torch.uint8)

            def body(c):
                if c.rank == src:
                    c.send(buf(payload), dst, tag=src * 100 + dst)
                elif c.rank == dst:
                    c.recv(buf(got), src, tag=src * 100 + dst)

            run_ranks(group, body)
            assert torch.equal(got, payload)
    # collectives still work after lazily opened links
    x = [torch.full((10,), c.rank, dtype=torch.int64) for c in group]
    run_ranks(group, lambda c: c.allreduce(buf(x[c.rank]), dtype=dt(x[c.rank])))
    assert all((v == sum(range(n))).all() for v in x)


@pytest.mark.parametrize("small_bytes", [1 << 30, 1024], ids=["latency_path", "ring_path"])
def test_float16_bfloat16_round_to_nearest_even(small_bytes):
    """Two ranks: one addition, so the result must be torch's (x0.float() + x1.float()) rounded."""
    g = make_group(2, job="rne", small_bytes=small_bytes, segment_bytes=4096)
    try:
        gen = torch.Generator().manual_seed(5)
        for tdt, dt in ((torch.float16, tn.DType.FLOAT16), (torch.bfloat16, tn.DType.BFLOAT16)):
            xs = [(torch.randn(50001, generator=gen) * 100).to(tdt) for _ in range(2)]
            xs[0][:4] = torch.tensor([65504.0, -0.0, 1e-7, 3.0]).to(tdt)  # overflow, signed zero, subnormal
            xs[1][:4] = torch.tensor([16.0, 0.0, 1e-7, -3.0]).to(tdt)
            expected = (xs[0].float() + xs[1].float()).to(tdt)
            w = [x.clone() for x in xs]
            run_ranks(g, lambda c: c.allreduce(buf(w[c.rank]), dtype=dt))
            assert torch.equal(w[0].view(torch.int16), expected.view(torch.int16))
            assert torch.equal(w[1].view(torch.int16), expected.view(torch.int16))
    finally:
        close_all(g)


@pytest.mark.parametrize("n", [3, 5])
def test_bitwise_deterministic(n):
    """Random floats (order-sensitive sums): identical bits on every rank and across two runs and
    two fresh groups, on both the latency path and the ring path."""
    gen = torch.Generator().manual_seed(n)
    size_max = 200003
    data = [torch.randn(size_max, generator=gen) * 10 ** (torch.rand(size_max, generator=gen) * 6 - 3)
            for _ in range(n)]
    assert all(d.dtype == torch.float32 for d in data)
    results = []
    for trial in range(2):
        g = make_group(n, job=f"det{n}{trial}", small_bytes=4096, segment_bytes=16384)
        try:
            for size in (100, 200003):
                for _ in range(2):
                    w = [d[:size].clone() for d in data]
                    run_ranks(g, lambda c: c.allreduce(buf(w[c.rank]), dtype=dt(w[c.rank])))
                    for r in range(1, n):
                        assert bytes(buf(w[r])) == bytes(buf(w[0]))
                    results.append((size, bytes(buf(w[0]))))
        finally:
            close_all(g)
    by_size: dict = {}
    for size, b in results:
        by_size.setdefault(size, set()).add(b)
    assert all(len(v) == 1 for v in by_size.values())
    # and the result is the sum up to float rounding
    ref = torch.stack([d.double() for d in data]).sum(dim=0)
    got = torch.frombuffer(bytearray(by_size[200003].pop()), dtype=torch.float32)
    assert torch.allclose(got.double(), ref, rtol=1e-4, atol=1e-2)


def test_async_work_and_ordering():
    g = make_group(3, job="async")
    try:
        bufs = [[torch.full((1000 * (k + 1),), c.rank + k, dtype=torch.float64) for k in range(6)] for c in g]

        def body(c):
            works = [c.allreduce_async(buf(b), dtype=dt(b)) for b in bufs[c.rank]]
            assert all(isinstance(w, tn.Work) for w in works)
            for w in works:
                assert w.wait(30.0) is True
                assert w.done() and w.exception() is None

        run_ranks(g, body)
        for k in range(6):
            expected = sum(r + k for r in range(3))
            assert all((bufs[r][k] == expected).all() for r in range(3))
        # wait(timeout) returns False while a peer has not joined the collective yet
        x = torch.ones(10, dtype=torch.float64)
        w = g[0].allreduce_async(buf(x), dtype=dt(x))
        assert w.wait(0.2) is False and not w.done()
        ys = [torch.ones(10, dtype=torch.float64), torch.ones(10, dtype=torch.float64)]
        run_ranks(g[1:], lambda c: c.allreduce(buf(ys[c.rank - 1]), dtype=dt(ys[c.rank - 1])))
        assert w.wait(10) and (x == 3).all()
    finally:
        close_all(g)


def test_single_rank_and_dtype_inference():
    c = tn.Communicator(0, 1, "solo")
    try:
        c.connect([c.address])
        # typed stdlib buffers: the dtype is inferred from the buffer format ('f' = float32)
        x = array.array("f", range(5))
        c.allreduce(x, op=tn.ReduceOp.AVG)
        assert list(x) == list(range(5))
        out = array.array("f", bytes(4 * 5))
        c.allgather(out, x)
        assert out == x
        with pytest.raises(ValueError, match="cannot infer dtype"):
            c.allreduce(array.array("b", [0, 0, 0]))  # no int8 dtype: must be explicit
        with pytest.raises(ValueError, match="item size"):
            c.allreduce(array.array("f", [0.0] * 3), dtype=tn.DType.FLOAT64)
        with pytest.raises(ValueError, match="contiguous"):
            c.allreduce(memoryview(array.array("f", [0.0] * 16))[1::4])  # not contiguous (a column of 4x4)
        c.allreduce(bytearray(8), dtype=tn.DType.INT64)
    finally:
        c.close()


def test_async_failure_surfaces_through_work():
    g = make_group(2, job="asyncfail", timeout=1.0)
    try:
        x = torch.ones(10, dtype=torch.float64)  # alive until the operation is over
        w = g[0].allreduce_async(buf(x), dtype=dt(x))
        g[1].close()
        with pytest.raises(tn.PeerLostError) as ei:
            w.wait(10)
        assert ei.value.peer == 1 and ei.value.epoch == 0 and ei.value.reporter == 0
        e = w.exception()
        assert isinstance(e, tn.PeerLostError) and e.peer == 1
        assert w.done()
        with pytest.raises(tn.PeerLostError):  # sticky until a commit
            g[0].barrier()
    finally:
        close_all(g)

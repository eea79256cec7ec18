"""The "tmrun" torch.distributed backend, in one process: one thread per rank, groups built with
:func:`tmrun.comm.backend.create_process_group` over a shared HashStore (what the registered
creator does), collectives called the way torch.distributed calls them (``pg.allreduce([t], opts)``).
Multi-process tests (dist.* API, DDP vs gloo, SIGKILL, standby replacement): test_backend_dist.py.
"""

from __future__ import annotations

import datetime
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

tn = pytest.importorskip("tmrun_native")

import tmrun  # noqa: E402,F401  (registers the backend)
from tmrun.comm import backend as tb  # noqa: E402

R = dist.ReduceOp
OPS = [R.SUM, R.AVG, R.MIN, R.MAX, R.PRODUCT]
SIZES = [0, 1, 7, 1031, 40001]  # 40001 float32 > 64 KiB: the pipelined ring path
REDUCIBLE = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
TIMEOUT = datetime.timedelta(seconds=30)


# ------------------------------------------------------------------------------------- helpers
def make_groups(n: int, **native: Any) -> list:
    native.setdefault("timeout", 5.0)
    store = dist.HashStore()
    pgs: list = [None] * n

    def mk(r: int) -> None:
        pgs[r] = tb.create_process_group(store, r, n, TIMEOUT, "0", tb.Options(native=native))

    run_threads(n, mk)
    return pgs


def run_threads(n: int, fn: Callable[[int], Any], timeout: float = 60.0) -> list:
    results: list = [None] * n
    errors: list = [None] * n

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"ranks still running after {timeout} s (hang)"
    for e in errors:
        if e is not None:
            raise e
    return results


@pytest.fixture
def groups():
    made: list = []

    def factory(n: int, **native: Any) -> list:
        pgs = make_groups(n, **native)
        made.extend(pgs)
        return pgs

    yield factory
    for pg in made:
        pg.shutdown()


def ar_opts(op: Any = R.SUM, async_op: bool = True) -> AllreduceOptions:
    o = AllreduceOptions()
    o.reduceOp = op
    o.asyncOp = async_op
    return o


def rs_opts(op: Any = R.SUM) -> ReduceScatterOptions:
    o = ReduceScatterOptions()
    o.reduceOp = op
    return o


def bc_opts(root: int) -> BroadcastOptions:
    o = BroadcastOptions()
    o.rootRank = root
    return o


def rank_data(dtype: torch.dtype, size: int, rank: int, op: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + size)
    if dtype == torch.bool:
        return torch.randint(0, 2, (size,), generator=g).bool()
    if dtype.is_floating_point:
        x = torch.randn(size, generator=g, dtype=torch.float64)
        return (1 + 0.1 * x if op == R.PRODUCT else x).to(dtype)
    if op == R.PRODUCT:
        x = torch.randint(1, 4, (size,), generator=g)
        if dtype != torch.uint8:
            x = x * (torch.randint(0, 2, (size,), generator=g) * 2 - 1)
        return x.to(dtype)
    lo = 0 if dtype == torch.uint8 else -50
    return torch.randint(lo, 80, (size,), generator=g).to(dtype)


def reference(inputs: list, op: Any, dtype: torch.dtype) -> torch.Tensor:
    n = len(inputs)
    if dtype == torch.bool:
        s = torch.stack(inputs)
        return s.any(0) if op in (R.SUM, R.MAX) else s.all(0)
    wide = torch.stack([x.double() if dtype.is_floating_point else x.long() for x in inputs])
    if op == R.SUM:
        out = wide.sum(0)
    elif op == R.PRODUCT:
        out = wide.prod(0)
    elif op == R.MIN:
        out = wide.min(0).values
    elif op == R.MAX:
        out = wide.max(0).values
    else:  # AVG: floats divide, integers truncate toward zero
        out = wide.sum(0) / n if dtype.is_floating_point else torch.div(wide.sum(0), n, rounding_mode="trunc")
    return out


TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12), torch.float16: (1e-2, 1e-2),
       torch.bfloat16: (2e-2, 5e-2)}


def check_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, op: Any) -> None:
    if dtype.is_floating_point and op in (R.SUM, R.AVG, R.PRODUCT):
        rtol, atol = TOL[dtype]
        assert torch.allclose(got.double(), ref, rtol=rtol, atol=atol), (dtype, op, got, ref)
    else:
        assert torch.equal(got, ref.to(dtype)), (dtype, op, got, ref)


# ------------------------------------------------------------------------------------- registry
def test_register_is_idempotent() -> None:
    tb.register()
    tb.register()
    assert "tmrun" in dist.Backend.backend_list
    assert dist.Backend.TMRUN == "tmrun"
    assert dist.Backend.backend_capability["tmrun"] == ["cpu", "cuda"]
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # tmrun is not made the default


# ------------------------------------------------------------------------------------- collectives
@pytest.mark.parametrize("dtype", REDUCIBLE + [torch.bool], ids=str)
def test_allreduce_every_op_and_size(groups, dtype: torch.dtype) -> None:
    n = 3
    pgs = groups(n)
    cases = [(op, size) for op in OPS for size in SIZES if not (dtype == torch.bool and op == R.AVG)]

    def body(r: int) -> list:
        out = []
        for i, (op, size) in enumerate(cases):
            t = rank_data(dtype, size, r, op)
            w = pgs[r].allreduce([t], ar_opts(op, async_op=i % 2 == 0))
            w.wait()
            assert w.is_completed() and w.get_future().value()[0] is t
            out.append(t)
        return out

    results = run_threads(n, body)
    for i, (op, size) in enumerate(cases):
        ref = reference([rank_data(dtype, size, r, op) for r in range(n)], op, dtype)
        check_close(results[0][i], ref, dtype, op)
        for r in range(1, n):  # every rank holds identical bits
            assert torch.equal(results[r][i], results[0][i])


def test_allreduce_world_sizes_and_shapes(groups) -> None:
    for n in (2, 4):
        pgs = groups(n)

        def body(r: int) -> list:
            ts = [torch.full((3, 5, 7), float(r + 1)), torch.tensor(float(r)),  # 3-d and 0-dim
                  (torch.arange(24, dtype=torch.float64).reshape(4, 6) * (r + 1)).t(),  # non-contiguous
                  torch.full((2,), complex(r, 1), dtype=torch.complex64)]  # complex: as real pairs
            pgs[r].allreduce(ts, ar_opts()).wait()  # several tensors in one call
            return ts

        res = run_threads(n, body)
        s = n * (n + 1) / 2
        assert torch.equal(res[0][0], torch.full((3, 5, 7), s))
        assert res[0][1].item() == sum(range(n))
        assert torch.equal(res[n - 1][2], (torch.arange(24, dtype=torch.float64).reshape(4, 6) * s).t())
        assert torch.equal(res[1][3], torch.full((2,), complex(sum(range(n)), n), dtype=torch.complex64))


def test_broadcast_every_root_any_dtype(groups) -> None:
    n = 3
    pgs = groups(n)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.bool, torch.complex64,
              torch.int64, torch.uint8]

    def value(dtype: torch.dtype, r: int, size: int) -> torch.Tensor:
        return (torch.arange(size) % 5 + r).to(dtype)

    def body(r: int) -> list:
        out = []
        for root in range(n):
            for dtype in dtypes:
                for size in (0, 1, 1031, 70001):
                    t = value(dtype, r, size)
                    pgs[r].broadcast([t], bc_opts(root)).wait()
                    out.append(t)
            nc = torch.arange(20, dtype=torch.float32).reshape(4, 5)[:, 1:4] * (r + 1)  # staged
            pgs[r].broadcast([nc], bc_opts(root)).wait()
            out.append(nc)
        return out

    res = run_threads(n, body)
    i = 0
    for root in range(n):
        for dtype in dtypes:
            for size in (0, 1, 1031, 70001):
                for r in range(n):
                    assert torch.equal(res[r][i], value(dtype, root, size)), (root, dtype, size)
                i += 1
        for r in range(n):
            assert torch.equal(res[r][i], torch.arange(20, dtype=torch.float32).reshape(4, 5)[:, 1:4] * (root + 1))
        i += 1


def test_allgather_list_and_tensor_forms(groups) -> None:
    n = 3
    pgs = groups(n)
    shapes = [(0,), (), (1,), (7,), (3, 5), (20001,)]

    def body(r: int) -> tuple:
        lists, singles = [], []
        for dtype in (torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.bool):
            for shape in shapes:
                inp = (torch.arange(max(1, int(torch.Size(shape).numel()))).reshape(-1)[: torch.Size(shape).numel()]
                       .reshape(shape) + 10 * r).to(dtype)
                outs = [torch.full(shape, -1).to(dtype) for _ in range(n)]
                pgs[r].allgather([outs], [inp], AllgatherOptions()).wait()
                lists.append((inp, outs))
                big = torch.empty((n * max(1, inp.numel()),), dtype=dtype)[: n * inp.numel()]
                pgs[r].all_gather_single(big, inp, AllgatherOptions()).wait()
                singles.append(big)
        return lists, singles

    res = run_threads(n, body)
    for k in range(len(res[0][0])):
        inputs = [res[r][0][k][0] for r in range(n)]
        for r in range(n):
            for q in range(n):
                assert torch.equal(res[r][0][k][1][q], inputs[q])
            assert torch.equal(res[r][1][k], torch.cat([x.reshape(-1) for x in inputs]))
    # the legacy names DDP-era code may call
    assert tb.TmrunProcessGroup._allgather_base is tb.TmrunProcessGroup.all_gather_single
    assert tb.TmrunProcessGroup._reduce_scatter_base is tb.TmrunProcessGroup.reduce_scatter_single


def test_reduce_scatter_list_and_tensor_forms(groups) -> None:
    n = 3
    pgs = groups(n)
    cases = [(dtype, op, size) for dtype in (torch.float32, torch.int64, torch.bfloat16)
             for op in OPS for size in (0, 1, 5, 3001)]

    def body(r: int) -> list:
        out = []
        for dtype, op, size in cases:
            full = rank_data(dtype, n * size, r, op)
            keep = full.clone()
            o1 = torch.empty(size, dtype=dtype)
            pgs[r].reduce_scatter([o1], [list(full.chunk(n) if size else [full[:0]] * n)], rs_opts(op)).wait()
            o2 = torch.empty(size, dtype=dtype)
            pgs[r].reduce_scatter_single(o2, full, rs_opts(op)).wait()
            assert torch.equal(full, keep)  # the input is left intact
            out.append((o1, o2))
        return out

    res = run_threads(n, body)
    for k, (dtype, op, size) in enumerate(cases):
        ref = reference([rank_data(dtype, n * size, r, op) for r in range(n)], op, dtype)
        for r in range(n):
            block = ref[r * size:(r + 1) * size]
            check_close(res[r][k][0], block, dtype, op)
            assert torch.equal(res[r][k][0], res[r][k][1])


PREMUL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.complex64]
# 1/3 has no exact float: NCCL casts it to the data's type before multiplying; a tensor factor too
PREMUL_FACTORS = {"float": 1 / 3, "tensor": torch.tensor(1 / 3, dtype=torch.float64), "int": 3}


def premul(factor: Any) -> Any:
    try:
        return dist._make_nccl_premul_sum(factor)
    except TypeError:  # torch 2.13 makes the op from a float or a tensor factor only
        pytest.skip(f"this torch ({torch.__version__}) makes no PREMUL_SUM with a {type(factor).__name__} factor")


def premultiplied(t: torch.Tensor, factor: Any) -> torch.Tensor:
    """What every rank contributes to a PREMUL_SUM: its input times the factor cast to the element
    type (NCCL's scalar has the data's type), complex numbers as pairs of reals."""
    view = torch.view_as_real(t) if t.is_complex() else t
    out = view * torch.as_tensor(factor, dtype=view.dtype)
    return torch.view_as_complex(out) if t.is_complex() else out


def premul_data(dtype: torch.dtype, size: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(104729 * rank + size)
    if dtype.is_complex:
        return torch.randn(size, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(size, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-50, 80, (size,), generator=g).to(dtype)


@pytest.mark.parametrize("factor", list(PREMUL_FACTORS), ids=str)
def test_premul_sum_in_every_reducing_collective_is_the_sum_of_premultiplied_inputs(groups, factor: str) -> None:
    """PREMUL_SUM (FSDP2's gradient division with a custom divide factor): every input is
    multiplied by the factor, then summed. Bit for bit what SUM gives over inputs premultiplied
    by hand, in allreduce (one tensor and several), reduce (non-root inputs left intact),
    reduce_scatter (list and single forms, coalesced; inputs left intact)."""
    n, f = 3, PREMUL_FACTORS[factor]
    pgs = groups(n)
    cases = [(dtype, size) for dtype in PREMUL_DTYPES for size in (0, 1, 7, 3001)]

    def reduce_opts(op: Any, root: int) -> ReduceOptions:
        o = ReduceOptions()
        o.reduceOp = op
        o.rootRank = root
        return o

    def body(r: int) -> list:
        pg, out = pgs[r], []
        for dtype, size in cases:
            x, y = premul_data(dtype, n * size, r), premul_data(dtype, size, r + n)
            got = {"allreduce": x.clone(), "coalesced": [x.clone(), y.clone()], "reduce": x.clone()}
            pg.allreduce([got["allreduce"]], ar_opts(premul(f))).wait()
            pg.allreduce_coalesced(got["coalesced"], ar_opts(premul(f), async_op=False)).wait()
            pg.reduce([got["reduce"]], reduce_opts(premul(f), 1)).wait()
            got["rs"], got["rs_single"] = torch.empty(size, dtype=dtype), torch.empty(size, dtype=dtype)
            blocks = list(x.chunk(n)) if size else [x[:0]] * n
            pg.reduce_scatter([got["rs"]], [blocks], rs_opts(premul(f))).wait()
            pg.reduce_scatter_single(got["rs_single"], x, rs_opts(premul(f))).wait()
            got["rs_coalesced"] = [torch.empty(size, dtype=dtype)]
            pg.reduce_scatter_single_coalesced(got["rs_coalesced"], [x], rs_opts(premul(f))).wait()
            assert torch.equal(x, premul_data(dtype, n * size, r))  # the reduce-scatters' input is intact
            if r != 1:
                assert torch.equal(got["reduce"], x)  # a non-root's tensor is left as it was
            # the reference: SUM of inputs premultiplied by hand, through the same backend
            want_x, want_y = premultiplied(x, f), premultiplied(y, f)
            want_rs = torch.empty(size, dtype=dtype)
            pg.allreduce([want_x, want_y], ar_opts(R.SUM)).wait()
            pg.reduce_scatter_single(want_rs, premultiplied(x, f), rs_opts(R.SUM)).wait()
            out.append((got, want_x, want_y, want_rs))
        return out

    results = run_threads(n, body)
    for k, (dtype, size) in enumerate(cases):
        for r in range(n):
            got, want_x, want_y, want_rs = results[r][k]
            assert torch.equal(got["allreduce"], want_x), (dtype, size)
            assert torch.equal(got["coalesced"][0], want_x) and torch.equal(got["coalesced"][1], want_y)
            if r == 1:
                assert torch.equal(got["reduce"], want_x)
            for name in ("rs", "rs_single"):
                assert torch.equal(got[name], want_rs), (name, dtype, size)
            assert torch.equal(got["rs_coalesced"][0], want_rs)
        if dtype.is_floating_point:  # and near the exact sum of the premultiplied inputs
            exact = sum(premultiplied(premul_data(dtype, n * size, r), f).double() for r in range(n))
            rtol, atol = TOL[dtype]
            assert torch.allclose(results[0][k][0]["allreduce"].double(), exact, rtol=rtol, atol=atol * max(1, float(f)))


def test_premul_sum_two_ranks_bitwise_against_torch_reference(groups) -> None:
    """Two ranks: one addition, so the result must equal torch's reference computation exactly
    (each input times the factor, then their sum), float32 and float64."""
    pgs = groups(2)
    f = 0.1

    def body(r: int) -> list:
        ts = [premul_data(dtype, 1031, r) for dtype in (torch.float32, torch.float64)]
        pgs[r].allreduce(ts, ar_opts(premul(f))).wait()
        return ts

    res = run_threads(2, body)
    for i, dtype in enumerate((torch.float32, torch.float64)):
        a, b = premul_data(dtype, 1031, 0), premul_data(dtype, 1031, 1)
        want = torch.sum(torch.stack([a * f, b * f]), dim=0)
        assert torch.equal(res[0][i], want) and torch.equal(res[1][i], want)


def test_premul_sum_served_locally_is_a_group_of_one(groups) -> None:
    """Local mode (and the aborted state): what a group of one gives, its input times the
    factor; reduce leaves a non-root's tensor as it is."""
    n, rank = 4, 2
    pg = tb.create_process_group(None, rank, n, TIMEOUT, "0", tb.Options(local=True))
    try:
        for f in (0.25, torch.tensor(0.25)):
            t = torch.arange(6.0)
            pg.allreduce([t], ar_opts(premul(f))).wait()
            assert torch.equal(t, torch.arange(6.0) * 0.25)
            o = torch.empty(2)
            pg.reduce_scatter([o], [[torch.full((2,), float(i)) for i in range(n)]], rs_opts(premul(f))).wait()
            assert torch.equal(o, torch.full((2,), rank * 0.25))
            o2 = torch.empty(2)
            pg.reduce_scatter_single(o2, torch.arange(2.0 * n), rs_opts(premul(f))).wait()
            assert torch.equal(o2, torch.arange(2.0 * n)[2 * rank:2 * rank + 2] * 0.25)
            mine, theirs = torch.ones(3), torch.ones(3)
            ro = ReduceOptions()
            ro.reduceOp, ro.rootRank = premul(f), rank
            pg.reduce([mine], ro).wait()
            ro.rootRank = 0
            pg.reduce([theirs], ro).wait()
            assert torch.equal(mine, torch.full((3,), 0.25)) and torch.equal(theirs, torch.ones(3))
    finally:
        pg.shutdown()


def test_premul_sum_errors_are_clear(groups) -> None:
    pg = groups(1)[0]
    with pytest.raises(tb.UnsupportedError, match="PREMUL_SUM is not defined for torch.bool"):
        pg.allreduce([torch.ones(2, dtype=torch.bool)], ar_opts(premul(0.5)))
    not_a_factor = SimpleNamespace(reduceOp=SimpleNamespace(op=R.PREMUL_SUM, factor="half"), asyncOp=True)
    with pytest.raises(ValueError, match="a number or a one-element tensor"):
        pg.allreduce([torch.ones(2)], not_a_factor)


def test_barrier_reduce_gather_scatter_p2p(groups) -> None:
    n = 4
    pgs = groups(n)

    def body(r: int) -> dict:
        pg = pgs[r]
        pg.barrier().wait()
        t = torch.full((5,), float(r + 1))
        ro = ReduceOptions()
        ro.rootRank = 2
        ro.reduceOp = R.MAX
        pg.reduce([t], ro).wait()
        go = GatherOptions()
        go.rootRank = 1
        outs = [torch.empty(3, dtype=torch.int32) for _ in range(n)] if r == 1 else []
        pg.gather([outs] if r == 1 else [], [torch.full((3,), r, dtype=torch.int32)], go).wait()
        so = ScatterOptions()
        so.rootRank = 3
        s = torch.empty(2, dtype=torch.float64)
        pg.scatter([s], [[torch.full((2,), 10.0 * i, dtype=torch.float64) for i in range(n)]] if r == 3 else [], so).wait()
        # p2p: every ordered pair, odd sizes, tags; lower rank sends first
        got = {}
        for peer in range(n):
            if peer == r:
                continue
            mine = torch.arange(1031, dtype=torch.float16) + r
            theirs = torch.empty(1031, dtype=torch.float16)
            if r < peer:
                pg.send([mine], peer, 7).wait()
                pg.recv([theirs], peer, 7).wait()
            else:
                pg.recv([theirs], peer, 7).wait()
                pg.send([mine], peer, 7).wait()
            got[peer] = theirs
        empty = torch.empty(0)
        if r == 0:
            pg.send([empty], 1, 0).wait()
        elif r == 1:
            pg.recv([empty], 0, 0).wait()
        return {"reduce": t, "gather": outs, "scatter": s, "p2p": got}

    res = run_threads(n, body)
    assert torch.equal(res[2]["reduce"], torch.full((5,), float(n)))
    assert torch.equal(res[0]["reduce"], torch.full((5,), 1.0))  # non-roots keep their input
    assert [int(x[0]) for x in res[1]["gather"]] == list(range(n))
    for r in range(n):
        assert torch.equal(res[r]["scatter"], torch.full((2,), 10.0 * r, dtype=torch.float64))
        for peer, t in res[r]["p2p"].items():
            assert torch.equal(t, torch.arange(1031, dtype=torch.float16) + peer)


# ------------------------------------------------------------------------------------- async
def test_async_works_futures_and_ordering(groups) -> None:
    n = 2
    pgs = groups(n)

    def body(r: int) -> Any:
        pg = pgs[r]
        ts = [torch.full((50000,), float(r + i)) for i in range(6)]
        works = [pg.allreduce([t], ar_opts()) for t in ts]  # all in flight at once
        chained = works[2].get_future().then(lambda f: f.value()[0].sum().item())
        for w in works:
            assert w.wait(datetime.timedelta(seconds=20))
        assert chained.wait() == 50000 * (1 + 2 * 2)
        for i, t in enumerate(ts):
            assert torch.equal(t, torch.full((50000,), float(1 + 2 * i)))
        # wait(timeout) on an operation that cannot complete yet: TimeoutError, then completes
        if r == 1:
            buf = torch.empty(4)
            w = pg.recv([buf], 0, 1)
            with pytest.raises(TimeoutError):
                w.wait(datetime.timedelta(milliseconds=200))
            assert not w.is_completed()
            pg.barrier().wait()  # queued behind the recv on the native thread
            w.wait()
            assert torch.equal(buf, torch.arange(4.0)) and w.is_success() and w.exception() is None
        else:
            time.sleep(0.5)
            pg.send([torch.arange(4.0)], 1, 1).wait()
            pg.barrier().wait()
        assert pg.synchronize(10) and pg.pending() == 0
        return True

    run_threads(n, body)


# ------------------------------------------------------------------------------------- errors
def test_errors_are_clear_and_raised_before_any_traffic(groups) -> None:
    pgs = groups(2)
    pg = pgs[0]
    before = pg.counters()
    f32 = torch.ones(4)
    bad = [
        (tb.UnsupportedError, "int16", lambda: pg.allreduce([torch.ones(2, dtype=torch.int16)], ar_opts())),
        (tb.UnsupportedError, "BAND", lambda: pg.allreduce([torch.ones(2, dtype=torch.int32)], ar_opts(R.BAND))),
        (tb.UnsupportedError, "torch.bool", lambda: pg.allreduce([torch.ones(2, dtype=torch.bool)], ar_opts(R.AVG))),
        (tb.UnsupportedError, "complex", lambda: pg.allreduce([torch.ones(2, dtype=torch.complex64)], ar_opts(R.MAX))),
        (ValueError, "not divisible", lambda: pg.all_to_all_single(torch.empty(3), torch.empty(3), [], [])),
        (ValueError, "split sizes", lambda: pg.all_to_all_single(torch.empty(3), torch.empty(3), [1, 1], [1, 2])),
        (tb.UnsupportedError, "any source", lambda: pg.recv_anysource([f32], 0)),
        (tb.UnsupportedError, "meta", lambda: pg.allreduce([torch.ones(2, device="meta")], ar_opts())),
        (ValueError, "output list holds 1", lambda: pg.allgather([[f32]], [f32], AllgatherOptions())),
        (ValueError, "same dtype", lambda: pg.allgather([[f32, torch.ones(4, dtype=torch.int32)]], [f32],
                                                            AllgatherOptions())),
        (ValueError, "output must be 2 x input", lambda: pg.all_gather_single(torch.empty(3), f32)),
        (ValueError, "input must be 2 x output", lambda: pg.reduce_scatter_single(torch.empty(3), f32)),
        (ValueError, "not a rank", lambda: pg.broadcast([f32], bc_opts(5))),
        (ValueError, "this rank", lambda: pg.send([f32], 0, 0)),
        (ValueError, "tag", lambda: pg.send([f32], 1, -1)),
        (TypeError, "torch.Tensor", lambda: pg.allreduce([[1, 2]], ar_opts())),
    ]
    for exc_type, text, fn in bad:
        with pytest.raises(exc_type, match=text):
            fn()
    assert pg.counters()["bytes_sent"] == before["bytes_sent"]
    assert pg.counters()["collectives"] == before["collectives"]
    # the group still works afterwards
    run_threads(2, lambda r: pgs[r].allreduce([torch.ones(3)], ar_opts()).wait())


def test_pg_options_type_checked() -> None:
    with pytest.raises(TypeError, match="pg_options"):
        tb.create_process_group(dist.HashStore(), 0, 1, TIMEOUT, "0", object())  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- local mode
def local_semantics(pg: Any, rank: int, n: int) -> None:
    t = torch.arange(6.0) + rank
    w = pg.allreduce([t], ar_opts(R.SUM))
    assert w.is_completed() and torch.equal(t, torch.arange(6.0) + rank)  # as is: valid values
    b = torch.full((3,), float(rank))
    pg.broadcast([b], bc_opts(0)).wait()
    assert torch.equal(b, torch.full((3,), float(rank)))
    outs = [torch.empty(2) for _ in range(n)]
    pg.allgather([outs], [torch.tensor([1.0, 2.0])], AllgatherOptions()).wait()
    assert all(torch.equal(o, torch.tensor([1.0, 2.0])) for o in outs)
    big = torch.empty(2 * n)
    pg.all_gather_single(big, torch.tensor([3.0, 4.0])).wait()
    assert torch.equal(big, torch.tensor([3.0, 4.0]).repeat(n))
    o = torch.empty(2)
    pg.reduce_scatter([o], [[torch.full((2,), float(i)) for i in range(n)]], rs_opts()).wait()
    assert torch.equal(o, torch.full((2,), float(rank)))
    o2 = torch.empty(2)
    pg.reduce_scatter_single(o2, torch.arange(2.0 * n), rs_opts()).wait()
    assert torch.equal(o2, torch.arange(2.0 * n)[2 * rank:2 * rank + 2])
    pg.barrier().wait()
    peer = (rank + 1) % n
    pg.send([torch.ones(3)], peer, 0).wait()
    r = torch.full((3,), 9.0)
    pg.recv([r], peer, 0).wait()
    assert torch.equal(r, torch.zeros(3))
    s = torch.full((2,), 5.0)
    so = ScatterOptions()
    so.rootRank = peer
    pg.scatter([s], [], so).wait()
    assert torch.equal(s, torch.zeros(2))


def test_local_mode_without_store_or_network() -> None:
    n, rank = 4, 2
    pg = tb.create_process_group(None, rank, n, TIMEOUT, "0", tb.Options(local=True))
    try:
        assert pg.local and pg.comm is None and pg.rank() == rank and pg.size() == n
        local_semantics(pg, rank, n)
        c = pg.counters()
        assert c["bytes_sent"] == c["bytes_recv"] == c["collectives"] == 0 and pg.links() == []
        assert pg.stats()["network_ops"] == 0 and pg.stats()["local_ops"] == 10
        with pytest.raises(RuntimeError, match="no communicator"):
            pg.set_local(False)
    finally:
        pg.shutdown()


def test_a_group_created_in_join_mode_refuses_collectives_until_the_joiner_is_healed() -> None:
    """A joiner's script building its model with a collective (distribute_tensor's scatter from
    rank 0) would wait forever for survivors that do not build theirs: it fails at once, with
    the way out in the message; after set_joining(None) (healed) the group works."""
    tb.set_joining(3)
    try:
        pg = tb.create_process_group(None, 1, 2, TIMEOUT, "5", tb.Options(local=True))
    finally:
        tb.set_joining(None)
    other = tb.create_process_group(None, 1, 2, TIMEOUT, "6", tb.Options(local=True))
    try:
        assert pg.joined_in == 3 and other.joined_in is None
        tb.set_joining(3)  # still joining: a later generation's joiner is not healed yet either
        t = torch.ones(2)
        with pytest.raises(tb.JoiningCollectiveError, match=r"allreduce on group '5' .*src_data_rank=None"):
            pg.allreduce([t])
        other.allreduce([t]).wait()  # a group of before the join is not concerned
        tb.set_joining(None)
        pg.allreduce([t]).wait()
        assert torch.equal(t, torch.ones(2))
    finally:
        tb.set_joining(None)
        pg.shutdown()
        other.shutdown()


def test_groups_created_in_join_mode_join_in_the_background_in_creation_order() -> None:
    """A joiner's groups are created at once in join mode (the script goes on building its model)
    and join the survivors' repaired communicators in the background, one after another in
    creation order; set_joining(None) returns once both are joined, and both then work. The
    survivor starts repairing only after both creations returned: had a creation waited for
    its join, it would never have returned."""
    stores = [dist.HashStore(), dist.HashStore()]
    for store in stores:
        store.set_timeout(datetime.timedelta(seconds=20))
    names = ["A", "B"]

    def made(r: int) -> list:
        return [tb.create_process_group(stores[i], r, 2, TIMEOUT, names[i], tb.Options(native={"timeout": 5.0}))
                for i in range(2)]

    before = run_threads(2, made)
    survivor = before[0]
    for pg in before[1]:
        pg.shutdown()  # rank 1 leaves
    tb.set_joining(1)
    try:
        joined = [tb.create_process_group(stores[i], 1, 2, TIMEOUT, names[i], tb.Options(local=False))
                  for i in range(2)]
        assert [pg.comm for pg in joined] == [None, None] and [pg.joined_in for pg in joined] == [1, 1]
    except BaseException:
        tb.set_joining(None)
        raise

    def repair() -> None:
        for pg in survivor:  # creation order, as tmrun.worker.subgroups.move_all does
            pg.prepare_replacement([1], 1)
            pg.comm.commit()
            pg.clear_aborted()

    repairing = threading.Thread(target=repair, daemon=True)
    repairing.start()
    try:
        tb.set_joining(None)  # waits for both joins
        repairing.join(30)
        assert not repairing.is_alive()
        assert all(pg.comm is not None and pg.comm.rank == 1 for pg in joined)
        checked = run_threads(2, lambda r: [_summed((survivor, joined)[r][i], r) for i in range(2)])
        assert checked == [[3.0, 3.0], [3.0, 3.0]]
    finally:
        for pg in survivor + joined:
            pg.shutdown()


def _summed(pg: Any, r: int) -> float:
    t = torch.full((3,), float(r + 1))
    pg.allreduce([t]).wait()
    return float(t[0])


def test_a_join_waits_through_the_getter_join_mode_was_given() -> None:
    """A survivor lost while the joiner builds its groups never publishes its address in them:
    the join waits through the getter join mode was given (the worker's gives up once a newer
    generation is published), not the store's own wait of its whole timeout, and ends when it
    raises: the group is created at once (its join runs in the background) and finish_joins()
    raises the getter's error; set_joining(None) drops it."""
    class Gone(Exception):
        pass

    asked: list[str] = []

    def get(store: Any, key: str) -> str:
        asked.append(key)
        raise Gone(key)

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=20))
    tb.set_joining(3, get=get, watch=lambda: None)
    started = time.monotonic()
    try:
        pg = tb.create_process_group(store, 1, 2, TIMEOUT, "7", tb.Options(local=False))
        with pytest.raises(Gone):
            tb.finish_joins()
        assert pg.comm is None
    finally:
        tb.set_joining(None)
    assert time.monotonic() - started < 10 and asked and "/replace" in asked[0], asked
    assert tb._JOIN_WAITS == (None, None)


def test_set_local_on_a_connected_group(groups) -> None:
    n = 3
    pgs = groups(n)
    run_threads(n, lambda r: pgs[r].allreduce([torch.ones(10)], ar_opts()).wait())
    before = [pg.counters() for pg in pgs]
    for pg in pgs:
        pg.set_local(True)
    for r, pg in enumerate(pgs):  # no peer needed: each rank alone
        local_semantics(pg, r, n)
    for pg, b in zip(pgs, before):
        c = pg.counters()
        assert (c["bytes_sent"], c["bytes_recv"], c["collectives"]) == (b["bytes_sent"], b["bytes_recv"], b["collectives"])
    for pg in pgs:
        pg.set_local(False)
    res = run_threads(n, lambda r: (lambda t: (pgs[r].allreduce([t], ar_opts()).wait(), t)[1])(torch.ones(10)))
    assert torch.equal(res[0], torch.full((10,), 3.0))


def test_env_var_local_mode_through_init_process_group_and_ddp(monkeypatch) -> None:
    """A standby: TMRUN_COMM_LOCAL=1, any store (a HashStore: no network), DDP constructed and
    trained for a shadow step over the local group."""
    monkeypatch.setenv(tb.ENV_LOCAL, "1")
    assert not dist.is_initialized()
    dist.init_process_group("tmrun", store=dist.HashStore(), rank=1, world_size=3, timeout=TIMEOUT)
    try:
        pg = tb.get_group()
        assert pg.local and pg.comm is None and dist.get_rank() == 1 and dist.get_backend() == "tmrun"
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        from tmrun.comm.ddp import wrap

        ddp = wrap(model)
        x = torch.randn(5, 4)
        ddp(x).sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ddp.parameters())
        local_grad = [p.grad.clone() for p in ddp.parameters()]
        model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        model2.load_state_dict(model.state_dict())
        model2(x).sum().backward()
        for g, p in zip(local_grad, model2.parameters()):  # DDP divides by the world size, the
            assert torch.allclose(g, p.grad / 3, atol=1e-6)  # local allreduce leaves the rest as is
        assert pg.counters()["bytes_sent"] == 0 and pg.stats()["network_ops"] == 0
    finally:
        dist.destroy_process_group()
    # pg_options works too
    monkeypatch.delenv(tb.ENV_LOCAL)
    dist.init_process_group("tmrun", store=dist.HashStore(), rank=0, world_size=2, timeout=TIMEOUT,
                            pg_options=tb.Options(local=True))
    try:
        assert tb.get_group().local
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------- failures
def test_failure_handler_absorbs_and_aborted_state_is_local(groups) -> None:
    """Rank 2 closes its communicator (its peers see the link close: PeerLostError naming 2).
    Rank 0 has a handler returning True, rank 1 none."""
    n = 3
    pgs = groups(n, timeout=2.0)
    run_threads(n, lambda r: pgs[r].allreduce([torch.ones(100)], ar_opts()).wait())
    calls: list = []
    pgs[0].set_failure_handler(lambda exc: calls.append(exc) or True)
    pgs[2].comm.close()

    def survivor(r: int) -> Any:
        pg = pgs[r]
        t = torch.ones(300000)
        w = pg.allreduce([t], ar_opts())
        if r == 0:
            assert w.wait() and w.is_success()
            return None
        with pytest.raises(tn.PeerLostError) as info:
            w.wait()
        return info.value

    res = run_threads(2, survivor)
    assert res[1].peer == 2 and "rank 2" in str(res[1]) and "tmrun allreduce failed" in str(res[1])
    assert len(calls) == 1 and isinstance(calls[0], tn.PeerLostError) and calls[0].peer == 2
    pg = pgs[0]
    assert pg.aborted
    before = pg.counters()
    t0 = time.perf_counter()
    for _ in range(10):  # complete at once, no network, valid values
        t = torch.full((1000,), 2.0)
        w = pg.allreduce([t], ar_opts())
        assert w.is_completed() and torch.equal(t, torch.full((1000,), 2.0))
        pg.barrier().wait()
        pg.broadcast([t], bc_opts(1)).wait()
    assert time.perf_counter() - t0 < 1.0
    after = pg.counters()
    assert after["bytes_sent"] == before["bytes_sent"] and after["collectives"] == before["collectives"]
    assert len(calls) == 1 and pg.stats()["absorbed_errors"] == 1 and pg.stats()["aborts"] == 1
    # the failure is sticky for the native epoch: leaving the aborted state without repairing the
    # communicator fails again (and the handler is asked again)
    pg.clear_aborted()
    assert not pg.aborted
    pg.set_failure_handler(None)
    with pytest.raises(tn.PeerLostError, match="rank 2"):
        pg.allreduce([torch.ones(3)], ar_opts(async_op=False)).wait()
    assert pg.stats()["raised_errors"] == 1
    # the handler's own exceptions do not swallow the error
    pg.set_failure_handler(lambda exc: 1 / 0)
    with pytest.raises(tn.PeerLostError):
        pg.allreduce([torch.ones(3)], ar_opts()).wait()
    # abort_collectives(): by hand
    pg.abort_collectives()
    assert pg.aborted and pg.allreduce([torch.ones(3)], ar_opts()).is_completed()


def test_attach_swaps_the_communicator_and_the_rank(groups) -> None:
    pgs = groups(2)
    # a separate native group of 2: attach rank 1's communicator to the group that was rank 0
    comms = [tn.Communicator(r, 2, "attach-test", 0, tn.Options(timeout=5.0)) for r in range(2)]
    try:
        addrs = [c.address for c in comms]
        run_threads(2, lambda r: comms[r].connect(addrs))
        pg = pgs[0]
        old = pg.attach(comms[1])
        assert old is not None and pg.comm is comms[1] and pg.rank() == 1 and pg.getRank() == 1
        other = tb.create_process_group(None, 0, 2, TIMEOUT, "0", tb.Options(comm=comms[0]))
        res = run_threads(2, lambda r: (lambda t: ((other if r == 0 else pg).allreduce([t], ar_opts()).wait(), t)[1])(
            torch.full((4,), float(r + 1))))
        assert torch.equal(res[0], torch.full((4,), 3.0)) and torch.equal(res[1], res[0])
        with pytest.raises(ValueError, match="world size"):
            pg.attach(tn.Communicator(0, 3, "x", 0, tn.Options()))
        with pytest.raises(ValueError, match="Options.comm is rank 0"):
            tb.create_process_group(None, 1, 2, TIMEOUT, "0", tb.Options(comm=comms[0]))
        pg.attach(old)  # back to the original (closed by the fixture)
        assert pg.rank() == 0
    finally:
        for c in comms:
            c.close()


# ------------------------------------------------------------------------------------- all-to-all
def _a2a_opts(async_op: bool = True) -> Any:
    from torch._C._distributed_c10d import AllToAllOptions

    o = AllToAllOptions()
    o.asyncOp = async_op
    return o


@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_to_all_single_even_and_uneven(groups, n: int) -> None:
    """Block j of rank r's input lands in block r of rank j's output: even splits (blocks larger
    than the 4 MiB socket buffers, so a cycle of blocking sends would hang), and uneven splits
    with empty blocks; synchronous and asynchronous."""
    pgs = groups(n)
    rows = 1 << 20 if n < 4 else 3  # 4 MiB of float32 per block for 2 and 3 ranks

    def even(r: int) -> None:
        inp = torch.arange(n * rows, dtype=torch.float32) + 1000 * r
        out = torch.empty_like(inp)
        pgs[r].all_to_all_single(out, inp, [], [], _a2a_opts(async_op=r % 2 == 0)).wait()
        want = torch.cat([torch.arange(r * rows, (r + 1) * rows, dtype=torch.float32) + 1000 * j for j in range(n)])
        assert torch.equal(out, want)

    run_threads(n, even)

    def split(r: int, j: int) -> int:  # rows rank r sends to rank j (some empty)
        return (r + 2 * j) % 3

    def uneven(r: int) -> None:
        send = [split(r, j) for j in range(n)]
        recv = [split(j, r) for j in range(n)]
        inp = torch.cat([torch.full((k, 2), float(100 * r + j), dtype=torch.float64) for j, k in enumerate(send)])
        out = torch.empty(sum(recv), 2, dtype=torch.float64)
        pgs[r].all_to_all_single(out, inp, recv, send, _a2a_opts()).wait()
        want = torch.cat([torch.full((k, 2), float(100 * j + r), dtype=torch.float64) for j, k in enumerate(recv)])
        assert torch.equal(out, want)

    run_threads(n, uneven)


def test_all_to_all_list_and_local_mode(groups) -> None:
    n = 3
    pgs = groups(n)

    def body(r: int) -> None:
        ins = [torch.full((j + 1,), 10 * r + j, dtype=torch.int64) for j in range(n)]
        outs = [torch.empty(r + 1, dtype=torch.int64) for _ in range(n)]
        work = pgs[r].alltoall(outs, ins, _a2a_opts())
        assert work.get_future().wait() == [outs]
        for j in range(n):
            assert torch.equal(outs[j], torch.full((r + 1,), 10 * j + r, dtype=torch.int64))

    run_threads(n, body)
    pg = tb.create_process_group(None, 1, 4, TIMEOUT, "0", tb.Options(local=True))
    try:  # the sandbox: every peer "sent" what this rank sends
        inp = torch.arange(8.0)
        out = torch.empty(8)
        pg.all_to_all_single(out, inp, [], [], _a2a_opts()).wait()
        assert torch.equal(out, inp) and pg.stats()["network_ops"] == 0
    finally:
        pg.shutdown()


def test_coalesced_async_completes_from_the_completer(groups) -> None:
    """An asynchronous coalesced op (what functional collectives and DTensor's full_tensor()
    issue) completes when its last part does: that part's completion runs the join's callback
    before its own done event is set (waiting for that event there deadlocked)."""
    n = 2
    pgs = groups(n)

    def body(r: int) -> None:
        outs = [torch.empty(2 * k) for k in (1, 3, 5)]
        ins = [torch.full((k,), float(r + k)) for k in (1, 3, 5)]
        o = AllgatherOptions()
        o.asyncOp = True
        work = pgs[r].all_gather_single_coalesced(outs, ins, o)
        assert work.wait(10)
        for k, out in zip((1, 3, 5), outs):
            assert torch.equal(out, torch.cat([torch.full((k,), float(j + k)) for j in range(n)]))
        rs_outs = [torch.empty(k) for k in (2, 4)]
        rs_ins = [torch.full((2 * k,), float(r + 1)) for k in (2, 4)]
        ro = ReduceScatterOptions()
        ro.asyncOp = True
        assert pgs[r].reduce_scatter_single_coalesced(rs_outs, rs_ins, ro).wait(10)
        assert all(torch.equal(x, torch.full_like(x, 3.0)) for x in rs_outs)

    run_threads(n, body, timeout=30)


# ------------------------------------------------------------------------------------- device plane
class _RefusingInner:
    """An inner group that refuses every operation (as torch's NCCL group refuses bad
    arguments); ``before_raising`` runs first (a loss watcher aborting the group meanwhile)."""

    def __init__(self, before_raising: Callable[[], None] = lambda: None) -> None:
        self.before_raising = before_raising
        self.calls = 0

    def allreduce(self, tensors: Any, opts: Any) -> Any:
        self.calls += 1
        self.before_raising()
        raise ValueError("Tensors must be contiguous")


class _OnePlane:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def group(self, store: Any, epoch: int, rank: int, size: int) -> Any:
        return self.inner


def _plane_group(groups, inner: Any) -> Any:
    pg = groups(1)[0]
    pg._plane_kind = "gloo"  # CPU tensors to the plane, as in its test mode
    pg._device_plane = lambda: _OnePlane(inner)
    return pg


def test_the_inner_groups_refusal_is_the_callers_error_at_once(groups) -> None:
    inner = _RefusingInner()
    pg = _plane_group(groups, inner)
    started = time.monotonic()
    with pytest.raises(ValueError, match="contiguous"):
        pg.allreduce([torch.ones(3)], AllreduceOptions())
    assert time.monotonic() - started < 2.0  # no wait for a loss the TCP side never saw
    assert inner.calls == 1 and pg.stats()["device_ops"] == 1


def test_an_inner_group_aborted_under_the_call_gives_the_step_up(groups) -> None:
    holder: list = []
    inner = _RefusingInner(before_raising=lambda: holder[0].abort_collectives())
    pg = _plane_group(groups, inner)
    holder.append(pg)
    work = pg.allreduce([torch.ones(3)], AllreduceOptions())
    assert work.wait() and work.is_success()  # absorbed: the step is redone after the recovery
    assert pg.stats()["absorbed_errors"] == 1 and pg.aborted


class _FailingLater:
    """An inner group whose operation fails after it was launched (its future's error)."""

    def allreduce(self, tensors: Any, opts: Any) -> Any:
        future: torch.futures.Future = torch.futures.Future()

        class Work:
            def get_future(self) -> torch.futures.Future:
                return future

        threading.Timer(0.1, lambda: future.set_exception(RuntimeError("inner collective failed"))).start()
        return Work()


def test_a_failed_device_collective_without_a_lost_peer_is_the_callers_error(groups, monkeypatch) -> None:
    """The TCP communicator names no lost peer within the grace: not a membership change (a bug,
    a bad argument), so the error reaches the caller and the group is not aborted."""
    monkeypatch.setattr(tb, "PLANE_LOSS_GRACE", 0.3)
    pg = _plane_group(groups, _FailingLater())
    work = pg.allreduce([torch.ones(3)], AllreduceOptions())
    with pytest.raises(RuntimeError, match="inner collective failed"):
        work.wait(timeout=10)
    assert not pg.aborted and pg.stats()["raised_errors"] == 1


def test_premul_sum_on_the_gloo_plane_goes_over_tcp(groups) -> None:
    """gloo refuses PREMUL_SUM: on the gloo plane (its test mode on CPU) the TCP path serves it."""
    inner = _RefusingInner()
    pg = _plane_group(groups, inner)
    t = torch.ones(3)
    pg.allreduce([t], ar_opts(premul(0.5))).wait()
    assert torch.equal(t, torch.full((3,), 0.5)) and inner.calls == 0 and pg.stats()["device_ops"] == 0


# ------------------------------------------------------------------ the device plane's inner calls
class _SyncOnlyInner:
    """An inner group as torch 2.11's ProcessGroupNCCL behaves: a blocking call (``asyncOp``
    False) runs on the caller's stream and returns no Work; an asynchronous one returns one."""

    def __init__(self) -> None:
        self.async_ops: list[bool] = []

    def allreduce(self, tensors: list, opts: Any) -> Any:
        self.async_ops.append(opts.asyncOp)
        if not opts.asyncOp:
            return None
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(tensors)
        return SimpleNamespace(get_future=lambda: fut)


def _plane_caller(inner: Any) -> Any:
    plane = SimpleNamespace(group=lambda *_args: inner)
    return SimpleNamespace(_device_plane=lambda: plane, _plane_store=None, _rank=0, _size=2, _abort_seq=0,
                           _stats={"network_ops": 0, "device_ops": 0}, _plane_done=lambda op, fut: op.complete())


@pytest.mark.parametrize("blocking_result", ["work", "none"])
def test_a_blocking_call_reaches_the_inner_group_asynchronously_and_completes(blocking_result: str) -> None:
    """``dist.all_reduce(t)`` passes ``asyncOp=False``: the plane asks the inner group for a Work
    anyway (its future completes the op); an inner group that still returns none (it ran on the
    caller's stream) completes the op at once, never an AttributeError."""
    inner = _SyncOnlyInner()
    if blocking_result == "none":
        inner.allreduce = lambda tensors, opts: None  # type: ignore[method-assign]
    opts = AllreduceOptions()
    opts.asyncOp = False
    tensor = torch.ones(3)
    op = tb._Op("allreduce", [tensor])
    work = tb.TmrunProcessGroup._run_on_plane(_plane_caller(inner), op, SimpleNamespace(epoch=0), "allreduce",
                                              ([tensor], opts))
    assert work.wait(5) and work.is_success()
    assert opts.asyncOp is True
    assert inner.async_ops == ([True] if blocking_result == "work" else [])


class _FailingAtLaunch:
    """An inner group whose communicator already saw the peer go: NCCL raises at the launch."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def allreduce(self, tensors: list, opts: Any) -> Any:
        raise self.error


def _failing_group(inner: Any, lost: Any) -> Any:
    """The parts of a TmrunProcessGroup that a launch on the plane and its failure handling use."""
    handled: list[BaseException] = []
    group = SimpleNamespace(_handler_lock=threading.Lock(), _aborted=False, _abort_seq=0, _plane_store=None,
                            _rank=0, _size=2, _stats={k: 0 for k in ("network_ops", "device_ops", "absorbed_errors",
                                                                      "raised_errors", "aborts")},
                            _comm=SimpleNamespace(wait_failure=lambda _grace, _gen: lost), handled=handled)
    plane = SimpleNamespace(group=lambda *_args: inner)
    group._device_plane = lambda: plane
    group._handler = lambda error: handled.append(error) or True
    for name in ("_plane_fail", "_fail", "_absorb"):
        setattr(group, name, getattr(tb.TmrunProcessGroup, name).__get__(group))
    group._abort_plane = lambda: None
    return group


@pytest.mark.parametrize("lost_peer_named", [True, False])
def test_an_nccl_error_at_the_launch_is_a_lost_peer_when_the_tcp_side_names_one(lost_peer_named: bool) -> None:
    """On torch 2.11 (H200) a survivor's next allreduce raised NCCL's remote error at its launch:
    it went to the script as a traceback and the job restarted. It is handled as the operation's
    own failure: absorbed as the lost peer the TCP side names, else the caller's error."""
    error = dist.DistBackendError("NCCL error: ncclRemoteError: remote process exited")
    lost = (1, 1, 0, "rank 1 lost") if lost_peer_named else None
    group = _failing_group(_FailingAtLaunch(error), lost)
    tensor = torch.ones(3)
    op = tb._Op("allreduce", [tensor])

    def launch() -> Any:
        return tb.TmrunProcessGroup._run_on_plane(group, op, SimpleNamespace(epoch=0), "allreduce",
                                                  ([tensor], AllreduceOptions()))

    if lost_peer_named:
        work = launch()
        assert work.wait(5) and work.is_success()
        assert len(group.handled) == 1 and "rank 1 lost" in str(group.handled[0])
        assert group._aborted and group._stats["absorbed_errors"] == 1
    else:
        # raised at the launch, as torch raises it: a Work holding it let the script go on into
        # NCCL's next communicator init, which hung (H200, a failed lazy P2P communicator)
        with pytest.raises(dist.DistBackendError, match="ncclRemoteError"):
            launch()
        assert op.done.is_set()
        assert not group.handled and group._stats["raised_errors"] == 1


def test_wait_makes_the_callers_streams_wait_for_the_operation() -> None:
    """TmrunWork.wait() returns only after the op's future was waited on: for CUDA tensors that
    future carries the outputs' CUDA events and its wait() is what makes the caller's stream wait
    for NCCL's. Without it, DDP's parameter check read its all_gather's output before NCCL wrote
    it (H200: "value cannot be converted to type int without overflow")."""
    op = tb._Op("allgather", [torch.zeros(2)])
    waited: list = []
    real = op.future

    class Recording:
        def wait(self) -> Any:
            waited.append(True)
            return real.wait()

    op.future = Recording()  # type: ignore[assignment]
    op.complete()
    assert tb.TmrunWork(op).wait(1) and waited == [True]


def test_torchs_refusal_of_the_arguments_at_the_launch_is_the_callers_at_once() -> None:
    group = _failing_group(_FailingAtLaunch(ValueError("Tensors must be contiguous")), (1, 1, 0, "rank 1 lost"))
    op = tb._Op("allreduce", [torch.ones(3)])
    with pytest.raises(ValueError, match="contiguous"):
        tb.TmrunProcessGroup._run_on_plane(group, op, SimpleNamespace(epoch=0), "allreduce",
                                           ([torch.ones(3)], AllreduceOptions()))
    assert not group.handled


def test_at_exit_every_group_is_closed_and_its_completer_stopped(groups) -> None:
    """At interpreter exit no completer thread may still wait inside the communicator: it would
    take the GIL back during finalization and abort the process ('terminate called without an
    active exception'). close_groups_at_exit closes the communicators (a pending receive fails)
    and stops the completer threads, within bounds."""
    pg0, pg1 = groups(2)
    pending = pg0.recv([torch.zeros(4)], 1, 5)  # rank 1 never sends: the completer waits in the communicator
    time.sleep(0.1)
    completer = pg0._completer._thread
    assert completer is not None and completer.is_alive()
    started = time.monotonic()
    tb.close_groups_at_exit()
    assert time.monotonic() - started < tb.EXIT_STOP_TIMEOUT + 3
    assert not completer.is_alive()
    assert pending.is_completed() and pg0._closed and pg1._closed
    assert pg0 not in tb.created_groups() and pg1 not in tb.created_groups()


# ------------------------------------------------------------------ P2P batches (batch_isend_irecv)
def _batch(pg: Any, items: list) -> Any:
    pg.start_coalescing(torch.device("cpu"))
    for kind, tensor, peer in items:
        (pg.send if kind == "send" else pg.recv)([tensor], peer, 0)
    return pg.end_coalescing(torch.device("cpu"))


def test_a_p2p_batch_moves_both_ways_at_once(groups) -> None:
    """Two ranks that each send the other 64 MiB and then receive: one by one, each rank's send
    waited for the other's receive, queued behind that rank's own send (a hang: found by
    bench/gpu_p2p.py on CPU). As a batch both directions move together."""
    pg0, pg1 = groups(2)
    n = 16 << 20  # float32: 64 MiB, more than loopback's socket buffers
    mine = [torch.full((n,), 1.0), torch.full((n,), 2.0)]
    got = [torch.zeros(n), torch.zeros(n)]
    works = [_batch(pg0, [("send", mine[0], 1), ("recv", got[0], 1)]),
             _batch(pg1, [("send", mine[1], 0), ("recv", got[1], 0)])]
    for work in works:
        assert work.wait(60)
    assert torch.equal(got[0], mine[1]) and torch.equal(got[1], mine[0])
    assert pg0.stats()["network_ops"] == 1  # one operation for the whole batch


def test_a_p2p_batch_keeps_the_order_per_peer_and_completes_each_items_work(groups) -> None:
    pg0, pg1, pg2 = groups(3)
    a, b = torch.arange(5.0), torch.arange(7.0)
    out = [torch.zeros(5), torch.zeros(7), torch.zeros(3)]
    pg0.start_coalescing(torch.device("cpu"))
    sends = [pg0.send([a], 1, 0), pg0.send([b], 1, 0), pg0.recv([out[2]], 2, 0)]
    batch0 = pg0.end_coalescing(torch.device("cpu"))
    batch1 = _batch(pg1, [("recv", out[0], 0), ("recv", out[1], 0)])
    batch2 = _batch(pg2, [("send", torch.full((3,), 9.0), 0)])
    for work in (batch0, batch1, batch2):
        assert work.wait(30)
    assert torch.equal(out[0], a) and torch.equal(out[1], b) and torch.equal(out[2], torch.full((3,), 9.0))
    for work in sends:
        assert work.wait(5) and work.is_success()


def test_a_p2p_batch_with_two_tags_is_refused_in_one_line(groups) -> None:
    (pg0, _pg1) = groups(2)
    pg0.start_coalescing(torch.device("cpu"))
    items = [pg0.send([torch.ones(2)], 1, 0), pg0.send([torch.ones(2)], 1, 1)]
    with pytest.raises(tb.UnsupportedError, match="one tag per batch"):
        pg0.end_coalescing(torch.device("cpu"))
    for work in items:  # each item's Work fails with the batch: a caller waiting on one does not hang
        assert work.is_completed() and not work.is_success()
        with pytest.raises(tb.UnsupportedError, match="one tag per batch"):
            work.wait(1)
    pg0.start_coalescing(torch.device("cpu"))  # the refused batch is closed
    pg0.end_coalescing(torch.device("cpu"))


def test_a_p2p_batch_in_local_mode_zeroes_what_it_receives() -> None:
    pg = tb.TmrunProcessGroup(0, 2, local=True)
    got = torch.ones(4)
    assert _batch(pg, [("send", torch.ones(4), 1), ("recv", got, 1)]).wait(5)
    assert torch.equal(got, torch.zeros(4))


class _CoalescingInner:
    supports_coalescing = True

    def __init__(self) -> None:
        self.calls: list = []

    def _start_coalescing(self) -> None:
        self.calls.append("start")

    def send(self, tensors: list, peer: int, tag: int) -> Any:
        self.calls.append(("send", peer))
        return "send-work"

    def recv(self, tensors: list, peer: int, tag: int) -> Any:
        self.calls.append(("recv", peer))
        return "recv-work"

    def _end_coalescing(self) -> Any:
        self.calls.append("end")
        return "batch-work"


def test_the_device_plane_runs_a_p2p_batch_as_one_group_call_where_the_inner_group_coalesces() -> None:
    """NCCL: one ncclGroupStart/End over the generation's collective communicator (torch's own
    batch path, which worked on the H200 where a lazily built 2-rank communicator did not)."""
    inner = _CoalescingInner()
    items = [("send", torch.ones(1), 1, 0), ("recv", torch.ones(1), 1, 0)]
    assert tb._call_inner(inner, "p2p_batch", (items, torch.device("cpu"))) == "batch-work"
    assert inner.calls == ["start", ("send", 1), ("recv", 1), "end"]
    inner.supports_coalescing = False  # gloo: each on its own, the completer waits for every Work
    inner.calls.clear()
    assert tb._call_inner(inner, "p2p_batch", (items, torch.device("cpu"))) == ["send-work", "recv-work"]
    assert inner.calls == [("send", 1), ("recv", 1)]


def test_coalescing_is_offered_exactly_where_torch_hands_a_python_group_its_batches() -> None:
    class Probe(dist.ProcessGroup):
        seen = False

        def start_coalescing(self, device: Any = None) -> None:
            type(self).seen = True

    try:
        Probe(0, 1)._start_coalescing(torch.device("cpu"))
    except Exception:  # noqa: BLE001
        pass
    assert tb.python_coalescing_supported() is Probe.seen
    assert tb.TmrunProcessGroup(0, 2, local=True).supports_coalescing is Probe.seen


def test_an_empty_batch_is_done_at_once_without_the_communicator() -> None:
    """torch's abort path opens and closes an empty batch on every group, closed ones too."""
    pg = tb.TmrunProcessGroup(0, 2, local=True)
    pg.start_coalescing(torch.device("cpu"))
    work = pg.end_coalescing(torch.device("cpu"))
    assert work.is_completed() and work.wait(1)


def test_a_coalescing_managers_collectives_are_in_its_work(groups) -> None:
    """torch's _coalescing_manager launches its collectives' coalesced form between
    start_coalescing and end_coalescing and keeps only end_coalescing's Work: that Work must wait
    for them (else the caller read the sums before they arrived)."""
    pg0, pg1 = groups(2)
    outs = []
    for pg, value in ((pg0, 1.0), (pg1, 2.0)):
        tensors = [torch.full((3,), value), torch.full((2,), value)]
        pg.start_coalescing(torch.device("cpu"))
        pg.allreduce_coalesced(tensors, tb.AllreduceCoalescedOptions())
        outs.append((pg.end_coalescing(torch.device("cpu")), tensors))
    for work, tensors in outs:
        assert work.wait(30)
        assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in tensors)
    # with a batch beside it: both in one Work
    got = [torch.zeros(2), torch.zeros(2)]
    works = []
    for rank, pg in enumerate((pg0, pg1)):
        sums = [torch.ones(4)]
        pg.start_coalescing(torch.device("cpu"))
        pg.allreduce_coalesced(sums, tb.AllreduceCoalescedOptions())
        pg.send([torch.full((2,), float(rank + 5))], 1 - rank, 0)
        pg.recv([got[rank]], 1 - rank, 0)
        works.append((pg.end_coalescing(torch.device("cpu")), sums))
    for work, sums in works:
        assert isinstance(work, tb.CoalescedWork) and work.wait(30) and work.is_success()
        assert torch.equal(sums[0], torch.full((4,), 2.0))
    assert torch.equal(got[0], torch.full((2,), 6.0)) and torch.equal(got[1], torch.full((2,), 5.0))


def test_a_receive_cut_off_by_a_lost_peer_is_filled_as_one_served_locally(groups) -> None:
    """A receive in flight when its peer died completed, absorbed, holding its buffer's old
    bytes: torch.empty's, from which a survivor's pipeline read a metadata size and asked for
    94 TB (torchtitan, a rank killed in the step after a validation). It is now filled as a
    receive served locally: by the replayer set (a pipeline start-up's), else with zeros."""
    pgs = groups(2, timeout=2.0)
    pgs[0].set_failure_handler(lambda exc: True)
    buffer = torch.full((4,), 7.0, requires_grad=True)  # a pipeline's: a leaf that requires grad
    work = pgs[0].recv([buffer], 1, 3)
    time.sleep(0.2)
    pgs[1].comm.close()
    assert work.wait() and pgs[0].stats()["absorbed_errors"] == 1
    assert torch.equal(buffer.detach(), torch.zeros(4)) and buffer.requires_grad
    pgs[0].clear_aborted()  # (the same receive again, aborted, with a replayer set)
    tb.set_p2p_replay(lambda group, src, tag, t: bool(t.fill_(5.0) is not None and tag == 3))
    try:
        again = torch.full((4,), 7.0)
        assert pgs[0].recv([again], 1, 3).wait() and torch.equal(again, torch.full((4,), 5.0))
    finally:
        tb.set_p2p_replay(None)


def test_a_local_receive_fills_a_buffer_that_requires_grad() -> None:
    """torch.distributed.pipelining receives activations into leaves that require grad; a group
    serving a doomed step locally zeroed them in place, which autograd refuses (the survivor of
    a lost pipeline neighbour raised instead of finishing its step)."""
    pg = tb.TmrunProcessGroup(0, 2, local=True)
    buffer = torch.ones(3, requires_grad=True)
    assert pg.recv([buffer], 1, 0).wait(1)
    assert torch.equal(buffer.detach(), torch.zeros(3)) and buffer.requires_grad


# -------------------------------------------------------------- background groups (a gloo group's stand-in)
def test_a_background_groups_thread_that_began_before_a_change_fails_and_a_new_one_works(groups) -> None:
    """``set_background``: a thread whose first operation on the group came before a change
    (the group aborted and repaired since) fails on each later one with BackgroundInterrupted,
    not served locally and not on the new membership (its peer's thread of the same save is
    gone); a thread that begins after the change uses the group as any."""
    pgs = groups(2)
    for pg in pgs:
        pg.set_background()
        assert pg.background and pg._device_types == [torch.device("cpu")]  # DCP's asynchronous save asks
    assert tb.TmrunProcessGroup(0, 1, local=True)._device_types == []  # (any other group: torch's answer)
    began, changed = threading.Barrier(3), threading.Event()

    def save_thread(r: int) -> str:
        t = torch.ones(4)
        pgs[r].allreduce([t], ar_opts(async_op=False)).wait()
        assert torch.equal(t, torch.full((4,), 2.0))
        began.wait(10)
        assert changed.wait(10)
        t = torch.ones(4)
        with pytest.raises(tb.BackgroundInterrupted, match="membership changed"):
            pgs[r].allreduce([t], ar_opts(async_op=False)).wait()
        assert torch.equal(t, torch.ones(4))  # untouched: no value made up
        return "cut"

    threads = [threading.Thread(target=lambda r=r: results.append(save_thread(r)), daemon=True) for r in range(2)]
    results: list = []
    for thread in threads:
        thread.start()
    began.wait(10)
    for pg in pgs:  # a change the runtime went through: aborted, then repaired
        pg.abort_collectives()
        pg.clear_aborted()
    changed.set()
    for thread in threads:
        thread.join(10)
    assert results == ["cut", "cut"]
    sums = run_threads(2, lambda r: _summed(pgs[r], r))  # new threads: the group as any
    assert sums == [3.0, 3.0] and all(pg.stats()["raised_errors"] == 1 for pg in pgs)  # 1 + 2 on each


def test_a_background_groups_thread_is_never_absorbed_and_the_main_threads_are(groups) -> None:
    """A peer lost under a background thread's operation: the failure handler still learns of
    it (the runtime starts the change from there) and the group enters the aborted state, but
    the operation fails (BackgroundInterrupted, the lost peer's error as its cause), as does
    the thread's next one; the main thread's operations on the aborted group are served
    locally as on any group (the step protocol)."""
    n = 3
    pgs = groups(n, timeout=2.0)
    run_threads(n, lambda r: pgs[r].allreduce([torch.ones(10)], ar_opts()).wait())
    calls: list = []
    for pg in pgs[:2]:
        pg.set_background()
        pg.set_failure_handler(lambda exc: calls.append(exc) or True)
    pgs[2].comm.close()

    def survivor(r: int) -> BaseException:
        with pytest.raises(tb.BackgroundInterrupted) as info:
            pgs[r].allreduce([torch.ones(300000)], ar_opts()).wait()
        with pytest.raises(tb.BackgroundInterrupted):  # the group is aborted now: at once
            pgs[r].allreduce([torch.ones(3)], ar_opts()).wait()
        return info.value

    errors = run_threads(2, survivor)
    assert all(isinstance(e.__cause__, tn.PeerLostError) for e in errors), errors
    assert calls and all(isinstance(c, tn.PeerLostError) for c in calls)
    assert pgs[0].aborted and pgs[1].aborted
    t = torch.full((5,), 3.0)
    work = pgs[0].allreduce([t], ar_opts())  # this test's main thread: served locally
    assert work.is_completed() and torch.equal(t, torch.full((5,), 3.0))

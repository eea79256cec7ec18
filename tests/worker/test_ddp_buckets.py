"""A DDP model built after a promotion takes its donors' gradient buckets (tmrun.worker.ddp_buckets).

Two ranks in threads of this process over a real two-member "tmrun" group: rank 1's "joiner"
builds its DDP model fresh (DDP's first bucket assignment) while rank 0's has trained two
iterations (rebuilt in its gradients' ready order). Adopted, the joiner's buckets are rank 0's,
built without one byte on the network, and a joint step gives the gradients two models that
trained together give; without it the first joint step's all-reduces pair other gradients."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

pytest.importorskip("tmrun_native")

from tests.comm.test_backend import make_groups, run_threads  # noqa: E402
from tmrun.comm import backend as tb  # noqa: E402
from tmrun.worker import ddp_buckets  # noqa: E402

CAP_MB = 0.0002  # a few buckets of this small model


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def _ddp(pg: dist.ProcessGroup, cap_mb: float = CAP_MB, **kwargs: object) -> DistributedDataParallel:
    with tb.served_locally():  # as a joiner builds it (LocalConstructions): no peer takes part
        return DistributedDataParallel(_module(), process_group=pg, bucket_cap_mb=cap_mb, **kwargs)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: DistributedDataParallel, rank: int, step: int) -> list[torch.Tensor]:
    for param in model.parameters():
        param.grad = None
    model(_batch(rank, step)).pow(2).sum().backward()
    return [param.grad.clone() for param in model.parameters()]


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    pgs = make_groups(2)
    yield pgs
    for pg in pgs:
        pg.shutdown()
    # two ranks' forwards in threads of one process: DDP's class-wide "active module" (saved and
    # restored around each forward, for dynamo) can be left set, and a later test's compile
    # would then plan DDP buckets for this test's model
    DistributedDataParallel._active_ddp_module = None


def _trained_pair(pgs: list, cap_mb: float = CAP_MB, **kwargs: object) -> list[DistributedDataParallel]:
    """Two ranks' models after two iterations together (rebuilt in the second). Built one after
    the other here (the seeded initialisation draws from torch's one global generator)."""
    models = [_ddp(pgs[r], cap_mb, **kwargs) for r in range(2)]
    run_threads(2, lambda r: [_train(models[r], r, step) for step in range(2)])
    return models


def _reset(*models: DistributedDataParallel) -> None:
    """The healing's reset (``reset_models``), on every member alike."""
    for model in models:
        model.reducer._reset_state()
        model._has_rebuilt_buckets = False


@pytest.mark.parametrize("as_view", [False, True], ids=["grads", "gradient_as_bucket_view"])
def test_a_fresh_model_takes_the_donors_buckets_and_then_reduces_as_they_do(  # type: ignore[no-untyped-def]
        pair, as_view: bool) -> None:
    options = {"gradient_as_bucket_view": as_view}
    reference, survivor = _trained_pair(pair, **options), _trained_pair(pair, **options)  # two pairs, one state
    donor = ddp_buckets.layout(survivor[0])
    assert survivor[0]._has_rebuilt_buckets and ddp_buckets.layout(survivor[1]) == donor
    joiner = _ddp(pair[1], **options)
    assert ddp_buckets.layout(joiner) != donor and ddp_buckets.needs_buckets([joiner])  # DDP's first assignment
    before = pair[1].stats()["network_ops"]
    assert ddp_buckets.adopt(joiner, donor) is True
    assert pair[1].stats()["network_ops"] == before  # the replay and the rebuild reached no peer
    assert ddp_buckets.layout(joiner) == donor and not ddp_buckets.needs_buckets([joiner])
    assert all(param.grad is None for param in joiner.parameters())
    assert ddp_buckets.adopt(joiner, donor) is False  # nothing left to change

    _reset(*reference, survivor[0], joiner)
    models = [survivor[0], joiner]
    for step in (2, 3, 4):  # the first step, then DDP's rebuild with its broadcast, then one more
        want = run_threads(2, lambda r: _train(reference[r], r, step))
        got = run_threads(2, lambda r: _train(models[r], r, step))
        for rank in (0, 1):
            assert all(torch.equal(a, b) for a, b in zip(got[rank], want[rank])), \
                (step, rank, [float((a - b).abs().max()) for a, b in zip(got[rank], want[rank])])
    assert ddp_buckets.layout(joiner) == ddp_buckets.layout(survivor[0]) == ddp_buckets.layout(reference[1])


def test_without_the_donors_buckets_the_first_joint_step_pairs_other_gradients(  # type: ignore[no-untyped-def]
        pair) -> None:
    """What the adoption prevents. With DDP's default bucket size this model has one bucket,
    first in parameter order, rebuilt in the gradients' ready order: the same length, so the
    fresh model's first step beside a rebuilt one all-reduces other gradients together and
    nothing fails: wrong gradients on both ranks, silently."""
    reference, survivor = _trained_pair(pair, cap_mb=25), _trained_pair(pair, cap_mb=25)
    joiner = _ddp(pair[1], cap_mb=25)
    assert len(ddp_buckets.layout(joiner)) == 1 and ddp_buckets.layout(joiner) != ddp_buckets.layout(survivor[0])
    _reset(*reference, survivor[0], joiner)
    want = run_threads(2, lambda r: _train(reference[r], r, 2))
    models = [survivor[0], joiner]
    got = run_threads(2, lambda r: _train(models[r], r, 2))
    assert not all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    # taken from the donor, the same step is right
    reference, survivor = _trained_pair(pair, cap_mb=25), _trained_pair(pair, cap_mb=25)
    joiner = _ddp(pair[1], cap_mb=25)
    ddp_buckets.adopt(joiner, ddp_buckets.layout(survivor[0]))
    _reset(*reference, survivor[0], joiner)
    want = run_threads(2, lambda r: _train(reference[r], r, 2))
    models = [survivor[0], joiner]
    got = run_threads(2, lambda r: _train(models[r], r, 2))
    assert all(torch.equal(a, b) for rank in (0, 1) for a, b in zip(got[rank], want[rank]))


@pytest.mark.parametrize("kind", ["static_graph", "comm_hook", "find_unused_parameters"])
def test_a_model_whose_buckets_cannot_be_rebuilt_is_refused(pair, kind: str) -> None:  # type: ignore[no-untyped-def]
    kwargs = {"static_graph": True} if kind == "static_graph" else (
        {"find_unused_parameters": True} if kind == "find_unused_parameters" else {})
    model = _ddp(pair[1], **kwargs)
    if kind == "comm_hook":
        model.register_comm_hook(None, lambda state, bucket: torch.futures.Future())  # never run here
    layout = ddp_buckets.layout(model)
    assert ddp_buckets.adopt(model, layout) is False  # the same buckets: nothing to rebuild
    assert bool(ddp_buckets.refusal(model)) == (kind != "find_unused_parameters")
    other = [list(reversed(bucket)) for bucket in reversed(layout)] if len(layout) > 1 else [layout[0][::-1]]
    with pytest.raises(ddp_buckets.BucketLayoutError, match="cannot be rebuilt"):
        ddp_buckets.adopt(model, other)


def test_buckets_of_another_model_are_refused(pair) -> None:  # type: ignore[no-untyped-def]
    model = _ddp(pair[1])
    with pytest.raises(ddp_buckets.BucketLayoutError, match="index 3 parameters"):
        ddp_buckets.adopt(model, [[0, 1], [2]])


def test_a_joiners_ddp_construction_is_served_locally_only_while_started(  # type: ignore[no-untyped-def]
        pair, monkeypatch) -> None:
    """A joining process (join mode) refuses its set-up's collectives on the job's groups; DDP's
    own construction-time ones are served locally between start() and stop()."""
    monkeypatch.setattr(tb, "_JOINING", 3)
    monkeypatch.setattr(pair[1], "joined_in", 3)
    built = ddp_buckets.LocalConstructions()
    built.start()
    try:
        before = pair[1].stats()["network_ops"]
        DistributedDataParallel(_module(), process_group=pair[1])
        assert pair[1].stats()["network_ops"] == before
    finally:
        assert built.stop() == 1
    with pytest.raises(tb.JoiningCollectiveError):
        DistributedDataParallel(_module(), process_group=pair[1])


def test_a_joiner_that_cannot_take_them_makes_every_member_fall_back_in_one_line(  # type: ignore[no-untyped-def]
        pair, capsys) -> None:
    """The healing's step (tmrun.worker.recovery): rank 1's model runs a static graph built
    after its promotion (a comm hook registered after the first step is the same case: the
    first step's check did not see it), so it cannot rebuild its buckets as rank 0's. Both
    members leave for the group restart at once (SystemExit(1)), each in one line, and the
    controller learns why; neither trains on."""
    import types

    from tests.native.conftest import close_all, make_group
    from tmrun.protocol import keys
    from tmrun.worker import recovery
    from tmrun.worker.transfer import HealPlan

    donor_model = _trained_pair(pair)[0]
    joiner_model = _ddp(pair[1], static_graph=True)
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=20))
    comms = make_group(2, job="buckets-refused")
    plan = HealPlan(target_step=4, donors=[0], needy=[1], fresh=[1], adopt_buckets=[1])

    def await_key(key: str, deadline: float, poll: float) -> bytes:
        store.wait([key])  # the HashStore's own wait (its timeout bounds it)
        return store.get(key)

    def member(rank: int) -> BaseException | None:
        ctx = types.SimpleNamespace(
            rank=rank, gen=3, env=types.SimpleNamespace(recovery_timeout=20.0), await_key=await_key,
            interrupter=types.SimpleNamespace(ddp_models=[donor_model if rank == 0 else joiner_model]))
        try:
            recovery._take_donors_buckets(ctx, comms[rank], store, plan)  # type: ignore[arg-type]
        except SystemExit as exc:
            return exc
        return None

    try:
        left = run_threads(2, member)
    finally:
        close_all(comms)
    assert [exc is not None and exc.code == 1 for exc in left] == [True, True]
    why = store.get(keys.UNHEALABLE).decode()
    assert why.startswith("rank 1's DDP model cannot take rank 0's gradient buckets: ") and "static_graph" in why, why
    said = capsys.readouterr().err
    assert "rank 0: rank(s) [1] could not take their donors' DDP gradient buckets; falling back" in said, said
    assert "rank 1: rank 1's DDP model cannot take rank 0's gradient buckets" in said, said

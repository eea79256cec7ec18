"""A change's waits for peers' addresses give up at once when a newer generation superseded it
(docs/reliability.md, "joiner waits for a dead rank's address"): a real TCPStore, the real
native bootstrap (``join_via_store`` / ``prepare_replacement``), the generation moving on while
they wait for an address that will never come. Before, they blocked in the store's ``get`` up to
its timeout (60 s in a worker), and the job fell back to a group restart."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tmrun.comm import native
from tmrun.control.replacement.core import write_gen_file
from tmrun.protocol import keys
from tmrun.protocol.environment import LaunchEnv
from tmrun.worker.context import Context, RecoveryError, Superseded
from tmrun.worker.roles import Role

STORE_TIMEOUT = 30.0  # what a blocking get would wait (a worker's store: 60 s)
BOUND = 3.0  # the stale wait must end this soon after the generation moved


def _context(tmp_path: Path, gen_file: bool) -> tuple[Context, dist.Store, Path]:
    path = tmp_path / "gen"
    if gen_file:
        write_gen_file(str(path), 1)
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=STORE_TIMEOUT))
    store = dist.PrefixStore("tmrun/ip/", tcp)
    store.set(keys.GEN, "1")
    ctx = Context(LaunchEnv(gen_file=str(path) if gen_file else "", recovery_timeout=120.0))
    ctx.store = store
    return ctx, store, path


def _move_on(store: dist.Store, path: Path, gen_file: bool, after: float) -> threading.Timer:
    def publish() -> None:
        store.set(keys.GEN, "2")  # the controller: the plan, then gen, then the node's file
        if gen_file:
            write_gen_file(str(path), 2)

    timer = threading.Timer(after, publish)
    timer.start()
    return timer


@pytest.mark.e2e  # over half a second: waits out a timeout (the unit subset stays within a minute)
@pytest.mark.parametrize("gen_file", [True, False], ids=["gen-file", "store-only"])
def test_a_joiner_waiting_for_a_lost_ranks_address_gives_up_when_the_generation_moves(
        tmp_path: Path, gen_file: bool) -> None:
    """Generation 1's joiner (rank 1 of 3) waits for rank 2's address; rank 2 was lost after
    generation 1 was published, so the controller publishes generation 2."""
    ctx, store, path = _context(tmp_path, gen_file)
    comm_store = ctx.comm_store()
    comm_store.set(native.address_key("job", 1, 0, keys.NATIVE_PREFIX), "127.0.0.1:1")  # rank 0 published
    timer = _move_on(store, path, gen_file, after=0.5)
    started = time.monotonic()
    with pytest.raises(Superseded, match="generation 2 superseded generation 1"):
        native.join_via_store(comm_store, 1, 3, "job", 1, get=ctx.address_getter(1), timeout=60.0)
    elapsed = time.monotonic() - started
    timer.join()
    assert 0.4 < elapsed < 0.5 + BOUND, elapsed  # not the store's timeout


def test_a_survivor_preparing_for_a_lost_joiner_gives_up_when_the_generation_moves(tmp_path: Path) -> None:
    """A survivor prepares generation 1 (the joiner of rank 1 never publishes: it died during
    its promotion); generation 2 supersedes it. The survivor's communicator is untouched."""
    ctx, store, path = _context(tmp_path, gen_file=True)
    comm_store = ctx.comm_store()
    survivor = native.Communicator(0, 2, "job", 0, native.make_options(timeout=60.0))
    try:
        timer = _move_on(store, path, True, after=0.3)
        started = time.monotonic()
        with pytest.raises(Superseded):
            native.prepare_replacement(comm_store, survivor, [1], 1, get=ctx.address_getter(1))
        assert time.monotonic() - started < 0.3 + BOUND
        timer.join()
    finally:
        survivor.close()


def test_the_getter_returns_published_addresses_and_still_watches_the_abort(tmp_path: Path) -> None:
    ctx, store, _ = _context(tmp_path, gen_file=True)
    get = ctx.address_getter(1)
    store.set("a", "127.0.0.1:5")
    assert get(store, "a") == "127.0.0.1:5"
    store.set(keys.ABORT, '{"reason": "no standby", "gen": 1}')
    with pytest.raises(RecoveryError) as info:
        get(store, "never")
    assert not isinstance(info.value, Superseded)


def test_a_rank_whose_recovery_the_controller_gives_up_leaves_in_one_line(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A survivor waiting for the next plan when the controller falls back (no warm standby in
    time): one line and exit 1 for the group restart; it raised a RecoveryError through the
    script before (a traceback on every such rank; found draining a node of an HSDP job whose
    other node was lost at the switch, 2026-12-06)."""
    from tmrun.protocol.environment import Mode
    from tmrun.worker.recovery import Recovery

    ctx, store, _ = _context(tmp_path, gen_file=False)
    ctx.env = dataclasses.replace(ctx.env, mode=Mode.ACTIVE)
    assert ctx.life.is_(Role.ACTIVE)
    store.set(keys.ABORT, '{"reason": "no warm standby node within 10s", "gen": 1}')
    with pytest.raises(SystemExit) as info:
        Recovery(ctx).recover()
    assert info.value.code == 1
    err = capfd.readouterr().err
    assert "rank 0: in-place recovery abandoned by the controller: no warm standby node within 10s; this worker " \
           "leaves for the group restart" in err, err
    assert "Traceback" not in err

"""Healing over real native communicators (one thread per rank): members agree on the last
committed step, and whoever is behind receives the tracked state bit for bit, in place."""

from __future__ import annotations

import sys
import os

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "native"))
from conftest import close_all, make_group, run_ranks  # noqa: E402

from tmrun.worker.tracked import TrackedState, TrackError  # noqa: E402
from tmrun.worker.transfer import TransferError, agree, heal  # noqa: E402


def make_member(seed: int, steps: int, width: int = 33) -> tuple[TrackedState, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(123)
    for _ in range(steps):
        model(torch.randn(8, width, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    state = TrackedState()
    state.track(model=model, optimizer=opt, scheduler=sched, epoch=steps * 10)
    return state, model, opt


def snapshot(state: TrackedState) -> list[bytes]:
    return [bytes(t.detach().reshape(-1).view(torch.uint8).tolist()) for _, t in state.tensors()]


@pytest.fixture
def staged(monkeypatch):
    """Every tensor treated as if it lived on a device (CUDA): moved through host copies."""
    from tmrun.comm import staging

    monkeypatch.setattr(staging, "is_host_ready", lambda tensor: False)


@pytest.mark.parametrize("n,needy,through_host,path", [
    (2, [1], False, "memory"), (2, [1], False, "socket"), (3, [1], False, "memory"), (3, [1], False, "socket"),
    (4, [0, 3], False, "memory"), (5, [2], False, "socket"), (3, [0, 2], True, "memory"),
    (3, [0, 2], True, "socket"),
])
def test_joiners_receive_the_state_bit_for_bit(n, needy, through_host, path, request):
    """One host: the needy members read every donor's stripe out of its memory, unless the
    members ask for the socket (TMRUN_HEAL_PATH=socket), as across hosts."""
    if through_host:  # the path of CUDA tensors: loaded to host copies, moved, stored back
        request.getfixturevalue("staged")
    comms = make_group(n, job=f"heal{n}")
    try:
        members = {}
        for rank in range(n):
            fresh = rank in needy
            # donors: identical replicas after 3 steps; joiners: another init, never stepped
            members[rank] = make_member(seed=1 if not fresh else 100 + rank, steps=3 if not fresh else 0)
        # where every tensor lives before: the state must arrive in place (same storage)
        params_before = {r: [p.data_ptr() for p in members[r][1].parameters()] for r in range(n)}

        def body(comm):
            state = members[comm.rank][0]
            fresh = comm.rank in needy
            plan = agree(comm, -1 if fresh else 3, state.layout_digest(), fresh, same_host_reads=path == "memory")
            return plan, heal(comm, state, plan, {"committed_step": 3})

        results, _ = run_ranks(comms, body, timeout=60)
        plans = [r[0] for r in results]
        assert all(p == plans[0] for p in plans)
        assert plans[0].target_step == 3 and plans[0].needy == needy
        reference = snapshot(members[plans[0].donors[0]][0])
        for rank in range(n):
            state, model, opt = members[rank]
            assert snapshot(state) == reference, f"rank {rank} differs"
            assert state.values["epoch"] == 30
            assert opt.param_groups[0]["lr"] == members[plans[0].donors[0]][2].param_groups[0]["lr"]
        for rank in needy:
            healed = results[rank][1]
            assert healed.nbytes == sum(len(b) for b in reference)  # every byte arrived here
            assert healed.meta == {"committed_step": 3} and healed.received
            assert list(healed.paths) == [path] and len(healed.paths[path]) == len(plans[0].donors)  # striped
        for rank in plans[0].donors:
            assert list(results[rank][1].paths) == [path] and len(results[rank][1].paths[path]) == len(needy)
        for rank, ptrs in params_before.items():
            assert [p.data_ptr() for p in members[rank][1].parameters()] == ptrs
    finally:
        close_all(comms)


def _heal_three(reads_on=(True, True, True)):
    """Rank 1 (new) heals from donors 0 and 2 on this host; returns (results, errors, states)."""
    comms = make_group(3, job="heal-paths")
    try:
        members = {0: make_member(1, 3), 1: make_member(100, 0), 2: make_member(1, 3)}

        def body(comm):
            state = members[comm.rank][0]
            plan = agree(comm, -1 if comm.rank == 1 else 3, state.layout_digest(), comm.rank == 1,
                         same_host_reads=reads_on[comm.rank])
            return heal(comm, state, plan, {"committed_step": 3})

        results, errors = run_ranks(comms, body, timeout=60, raise_errors=False)
        return results, errors, {r: snapshot(m[0]) for r, m in members.items()}
    finally:
        close_all(comms)


def test_each_pair_takes_its_own_path():
    """Donor 2 allows no same-host reads: its stripe goes over the socket, donor 0's is read."""
    results, errors, states = _heal_three(reads_on=(True, True, False))
    assert errors == [None, None, None] and states[1] == states[0]
    healed = results[1]
    assert sorted(healed.paths) == ["memory", "socket"] and healed.nbytes == sum(len(b) for b in states[0])
    assert list(results[0].paths) == ["memory"] and list(results[2].paths) == ["socket"]
    assert healed.describe().startswith("memory ") and "from 1 donor, socket " in healed.describe()


@pytest.mark.parametrize("how", ["refused", "gone"])
def test_a_donor_whose_memory_cannot_be_read_sends_its_stripe_over_the_socket(monkeypatch, how):
    from tmrun.worker import peer_read

    original = peer_read.read_part

    def unreadable(pid, remote, views, what):  # rank 2's memory only
        if "rank 2" not in what:
            return original(pid, remote, views, what)
        if how == "gone":  # its pid no longer exists
            return original(2**22 + 12345, remote, views, what)
        raise peer_read.PeerReadError(f"could not read {what} (pid {pid}): Operation not permitted")

    monkeypatch.setattr(peer_read, "read_part", unreadable)
    results, errors, states = _heal_three()
    assert errors == [None, None, None] and states[1] == states[0]
    assert sorted(results[1].paths) == ["memory", "socket"]
    assert list(results[0].paths) == ["memory"] and list(results[2].paths) == ["socket"]
    assert "rank 2" in results[1].describe()  # the log says why the socket took it


def test_a_damaged_copy_fails_on_both_sides(monkeypatch):
    """A stripe read out of donor 2's memory that does not match its CRC: the needy member and
    donor 2 raise TransferError (neither goes on with it); donor 0's stripe was fine."""
    from tmrun.worker import peer_read

    original = peer_read.read_part

    def flip_a_byte(pid, remote, views, what):
        moved = original(pid, remote, views, what)
        if "rank 2" in what:
            views[-1][-1] ^= 0xFF
        return moved

    monkeypatch.setattr(peer_read, "read_part", flip_a_byte)
    results, errors, _ = _heal_three()
    assert isinstance(errors[1], TransferError) and "checksum mismatch in the stripe of rank 2" in str(errors[1])
    assert isinstance(errors[2], TransferError) and "rank 1 could not take the state" in str(errors[2])
    assert errors[0] is None and list(results[0].paths) == ["memory"]


def test_the_log_says_which_path_moved_the_bytes():
    from tmrun.worker.transfer import Healed

    healed = Healed({}, received=True)
    healed.add("memory", 302_000_000)
    assert healed.describe() == "memory 302 MB from 1 donor"
    donor = Healed({})
    donor.add("socket", 1_500_000)
    donor.add("socket", 1_500_000)
    assert donor.describe() == "socket 3.00 MB to 2 members"
    assert Healed({}).describe() == "nothing moved here"


def test_a_member_one_step_behind_heals_from_the_others():
    comms = make_group(3, job="behind")
    try:
        members = {0: make_member(1, 4), 1: make_member(1, 3), 2: make_member(1, 4)}

        def body(comm):
            state = members[comm.rank][0]
            committed = 3 if comm.rank == 1 else 4
            plan = agree(comm, committed, state.layout_digest(), False)
            heal(comm, state, plan, {})
            return plan

        results, _ = run_ranks(comms, body, timeout=60)
        assert results[0].target_step == 4 and results[0].donors == [0, 2] and results[0].needy == [1]
        assert snapshot(members[1][0]) == snapshot(members[0][0])
    finally:
        close_all(comms)


@pytest.mark.parametrize("tails,committed,expected", [
    ([4, -1, -1], [4, 4, -1], True),  # one survivor's tail of the agreed step was void: all redo it, the joiner too
    ([-1, -1, -1], [4, 4, -1], False),  # nobody's
    ([3, -1, -1], [4, 4, -1], False),  # an older step's tail (redone in step 4, which committed since)
    ([-1, -1, -1], [-1, -1, -1], False),  # nothing committed: a joiner's -1 is no tail
    ([4, -1, -1], [4, 3, -1], True),  # a survivor one step behind: the agreed step is still 4
])
def test_every_member_learns_whether_the_agreed_steps_tail_was_void(tails, committed, expected):
    """tm.voided_step's agreement: whether the tail of the agreed last step (what a script did
    after its update) was void on any member, the same answer on every member, joiners included."""
    comms = make_group(3, job="tail")
    try:
        members = {r: make_member(1, 4) for r in range(3)}

        def body(comm):
            fresh = committed[comm.rank] < 0 and comm.rank == 2
            return agree(comm, committed[comm.rank], members[comm.rank][0].layout_digest(), fresh,
                         void_tail=tails[comm.rank])

        results, _ = run_ranks(comms, body, timeout=60)
        assert [plan.void_tail for plan in results] == [expected] * 3, results
    finally:
        close_all(comms)


def test_every_member_learns_who_must_take_its_donors_ddp_buckets():
    """A joiner whose DDP models were built after its promotion says so in the agreement
    (tmrun.worker.ddp_buckets): every member learns the same list."""
    comms = make_group(3, job="buckets")
    try:
        members = {r: make_member(1, 4) for r in range(3)}

        def body(comm):
            fresh = comm.rank == 1
            return agree(comm, -1 if fresh else 4, members[comm.rank][0].layout_digest(), fresh, adopt_buckets=fresh)

        results, _ = run_ranks(comms, body, timeout=60)
        assert [plan.adopt_buckets for plan in results] == [[1]] * 3, results
        assert [plan.donors_of(1) for plan in results] == [[0, 2]] * 3
    finally:
        close_all(comms)


def test_nobody_holding_the_state_is_an_error():
    comms = make_group(2, job="nobody")
    try:
        members = {r: make_member(r, 0) for r in range(2)}
        _, errors = run_ranks(
            comms, lambda c: agree(c, -1, members[c.rank][0].layout_digest(), True), raise_errors=False
        )
        assert all(isinstance(e, TransferError) for e in errors)
    finally:
        close_all(comms)


def test_track_refuses_what_cannot_move():
    state = TrackedState()
    with pytest.raises(TrackError, match="picklable"):
        state.track(handle=lambda: None)


@pytest.mark.parametrize("leaver_reads,joiner_reads,path,through_host", [
    (True, True, "memory", False), (False, True, "socket", False), (True, False, "socket", False),
    (False, False, "socket", False), (True, True, "memory", True), (False, False, "socket", True),
])
def test_handover_delivers_the_model_first_and_the_optimizer_state_later(leaver_reads, joiner_reads, path,
                                                                         through_host, request):
    """A migration: take_over returns once the model arrived; the optimizer's state arrives in
    the background and is complete (bit for bit, in place) after finish(). On one host the
    joiner reads the leaver's memory unless either side turned that off."""
    from tmrun.worker.transfer import hand_over, take_over

    if through_host:  # the path of CUDA tensors
        request.getfixturevalue("staged")
    comms = make_group(2, job="handover")
    try:
        leaver_state, _, _ = make_member(seed=1, steps=3)
        joiner_state, joiner_model, joiner_opt = make_member(seed=7, steps=1)
        opt_ptrs = [t.data_ptr() for name, t in joiner_state.tensors() if name.startswith("optimizer.")]
        seen: dict[str, object] = {}

        def body(comm):
            if comm.rank == 0:
                return hand_over(comm, leaver_state, {"committed_step": 3}, same_host_reads=leaver_reads)
            meta, pending, received = take_over(comm, joiner_state, same_host_reads=joiner_reads)
            seen["path"] = pending.path
            model_now = [bytes(t.detach().reshape(-1).view(torch.uint8).tolist())
                         for name, t in joiner_state.tensors() if name.startswith("model.")]
            seen.update(meta=meta, received=received, model=model_now, deferred=pending.nbytes)
            pending.finish()
            return received

        results, _ = run_ranks(comms, body, timeout=60)
        assert snapshot(joiner_state) == snapshot(leaver_state)
        assert seen["meta"] == {"committed_step": 3} and seen["path"] == path
        leaver_model = [name for name, _ in leaver_state.tensors() if name.startswith("model.")]
        assert len(seen["model"]) == len(leaver_model)  # the model was complete when take_over returned
        assert seen["model"] == snapshot(leaver_state)[: len(leaver_model)]
        assert results[0] == seen["received"] + seen["deferred"] and seen["deferred"] > 0
        assert [t.data_ptr() for name, t in joiner_state.tensors() if name.startswith("optimizer.")] == opt_ptrs
        assert joiner_state.values["epoch"] == 30
    finally:
        close_all(comms)


def _handover_pair(monkeypatch, tamper):
    """Run a handover on one host with ``tamper(monkeypatch)`` applied; returns (errors, joiner state)."""
    from tmrun.worker.transfer import hand_over, take_over

    tamper(monkeypatch)
    comms = make_group(2, job="handover-bad")
    try:
        leaver_state, _, _ = make_member(seed=1, steps=3)
        joiner_state, _, _ = make_member(seed=7, steps=1)

        def body(comm):
            if comm.rank == 0:
                return hand_over(comm, leaver_state, {"committed_step": 3})
            _, pending, _ = take_over(comm, joiner_state)
            pending.finish()
            return pending.path

        results, errors = run_ranks(comms, body, timeout=60, raise_errors=False)
        return results, errors
    finally:
        close_all(comms)


def test_handover_falls_back_to_the_socket_when_the_leaver_cannot_be_read(monkeypatch):
    from tmrun.worker import peer_read

    def unreadable(mp):  # as if another user's process, or a kernel that forbids the reads
        mp.setattr(peer_read.tmrun_native, "read_peer_memory",
                   lambda *a: (_ for _ in ()).throw(PermissionError(1, "Operation not permitted")))

    results, errors = _handover_pair(monkeypatch, unreadable)
    assert errors == [None, None] and results[1] == "socket"


@pytest.mark.parametrize("part", ["the model", "the optimizer state"])
def test_handover_damaged_in_memory_fails_on_both_sides(monkeypatch, part):
    """A copy that does not match the leaver's checksum: the joiner raises TransferError (the
    runtime then heals it from the other ranks), and the leaver learns of it instead of waiting."""
    from tmrun.worker import peer_read
    from tmrun.worker.transfer import TransferError

    original = peer_read.read_part

    def flip_a_byte(pid, remote, views, what):
        moved = original(pid, remote, views, what)
        if what == part:
            views[-1][0] ^= 0xFF
        return moved

    results, errors = _handover_pair(monkeypatch, lambda mp: mp.setattr(peer_read, "read_part", flip_a_byte))
    assert isinstance(errors[1], TransferError) and "checksum mismatch" in str(errors[1])
    assert isinstance(errors[0], TransferError) and "could not take the state" in str(errors[0])


def test_handover_from_a_dead_leaver_is_a_transfer_error(monkeypatch):
    from tmrun.worker import peer_read
    from tmrun.worker.transfer import TransferError

    original = peer_read.read_part

    def gone(pid, remote, views, what):  # the leaver's pid no longer exists
        return original(2**22 + 12345, remote, views, what)

    results, errors = _handover_pair(monkeypatch, lambda mp: mp.setattr(peer_read, "read_part", gone))
    assert isinstance(errors[1], TransferError) and "could not read the model" in str(errors[1])


def test_a_malformed_hello_is_a_one_line_transfer_error():
    import struct

    from tmrun.worker.transfer import TAG_META, TransferError, hand_over

    comms = make_group(2, job="handover-hello")
    try:
        leaver_state, _, _ = make_member(seed=1, steps=1)

        def body(comm):
            if comm.rank == 0:
                return hand_over(comm, leaver_state, {"committed_step": 1})
            blob = b"[not a dict"
            comm.send(struct.pack("<Q", len(blob)), 0, TAG_META)
            comm.send(blob, 0, TAG_META)
            return None

        _, errors = run_ranks(comms, body, timeout=60, raise_errors=False)
        assert isinstance(errors[0], TransferError) and str(errors[0]) == "malformed hello from rank 1"
    finally:
        close_all(comms)


# -- deferred healing: the model first, the optimizer state read after heal returned ------------


class Board:
    """The CRC board of deferred healing, between threads (the runtime's goes through the store)."""

    def __init__(self) -> None:
        import threading

        self._posted: dict[tuple[int, int], int] = {}
        self._changed = threading.Condition()

    def put(self, donor: int, needy: int, crc: int) -> None:
        with self._changed:
            self._posted[donor, needy] = crc
            self._changed.notify_all()

    def get(self, donor: int, needy: int, timeout: float) -> int:
        with self._changed:
            if not self._changed.wait_for(lambda: (donor, needy) in self._posted, timeout):
                raise TransferError("no checksum posted")
            return self._posted[donor, needy]


def _heal_deferred(n: int, needy: list[int], tamper=None, monkeypatch=None, no_overlap=()):
    """Every member on this host, state in host memory: returns (results, errors, members).
    ``no_overlap``: members with no CPU core to spare for a background read."""
    from tmrun.worker import peer_read

    if tamper is not None:
        original = peer_read.read_part

        def tampered(pid, remote, views, what):
            moved = original(pid, remote, views, what)
            tamper(views, what)
            return moved

        monkeypatch.setattr(peer_read, "read_part", tampered)
    comms = make_group(n, job=f"defer{n}")
    board = Board()
    try:
        members = {r: make_member(100 + r, 0) if r in needy else make_member(1, 3) for r in range(n)}

        def body(comm):
            state = members[comm.rank][0]
            fresh = comm.rank in needy
            plan = agree(comm, -1 if fresh else 3, state.layout_digest(), fresh, state_tensors=state.tensors(),
                         overlap=comm.rank not in no_overlap)
            return plan, heal(comm, state, plan, {"committed_step": 3}, board=board)

        results, errors = run_ranks(comms, body, timeout=60, raise_errors=False)
        return results, errors, members
    finally:
        close_all(comms)


@pytest.mark.parametrize("n,needy", [(2, [1]), (3, [1]), (4, [0, 3])])
def test_deferred_healing_returns_with_the_model_and_delivers_the_optimizer_state_later(n, needy):
    results, errors, members = _heal_deferred(n, needy)
    assert errors == [None] * n
    plans = [plan for plan, _ in results]
    assert all(plan.defer for plan in plans)
    reference = snapshot(members[plans[0].donors[0]][0])
    model_tensors = len(members[0][1].state_dict())
    for rank in needy:
        healed = results[rank][1]
        assert healed.deferred is not None and healed.received
        assert snapshot(members[rank][0])[:model_tensors] == reference[:model_tensors]  # the model at once
        status: list[str] = []
        healed.deferred.start(status.append)
        healed.deferred.wait(timeout=30)
        assert status == ["ok"]
        assert healed.deferred.seconds is not None and healed.deferred.seconds >= 0  # for the worker's line
        assert snapshot(members[rank][0]) == reference  # the optimizer state after the wait
    for rank in plans[0].donors:
        assert results[rank][1].served == needy and results[rank][1].deferred is None


@pytest.mark.parametrize("n,needy,no_overlap", [(2, [1], [1]), (2, [1], [0]), (3, [1], [2]), (4, [0, 3], [0])])
def test_a_member_without_a_spare_core_has_everything_read_before_healing_returns(n, needy, no_overlap):
    """One member (donor or healed) has no core to spare (tmrun.worker.cpu_budget): every member
    plans alike, and the healed members read the optimizer state out of the donors' memory
    before heal returns, nothing left in the background."""
    results, errors, members = _heal_deferred(n, needy, no_overlap=no_overlap)
    assert errors == [None] * n
    plans = [plan for plan, _ in results]
    assert all(not plan.defer and plan.read_first for plan in plans)
    reference = snapshot(members[plans[0].donors[0]][0])
    for rank in needy:
        healed = results[rank][1]
        assert healed.deferred is None and healed.received and list(healed.paths) == ["memory"]
        assert snapshot(members[rank][0]) == reference  # model and optimizer state, at once
    for rank in plans[0].donors:
        assert results[rank][1].served == []  # no read outstanding: the donor may step at once


def test_deferred_optimizer_state_damaged_in_memory_cannot_be_stepped_with(monkeypatch):
    def flip(views, what):
        if "optimizer state" in what:
            views[-1][-1] ^= 0xFF

    results, errors, _ = _heal_deferred(2, [1], tamper=flip, monkeypatch=monkeypatch)
    assert errors == [None, None]  # the model arrived intact: heal returned on both
    deferred = results[1][1].deferred
    status: list[str] = []
    deferred.start(status.append)
    with pytest.raises(TransferError, match="optimizer state read after healing is unusable: checksum mismatch"):
        deferred.wait(timeout=30)
    assert len(status) == 1 and status[0].startswith("error: checksum mismatch")


def test_no_deferral_across_hosts_or_for_device_tensors():
    comms = make_group(2, job="nodefer")
    try:
        members = {0: make_member(1, 3), 1: make_member(100, 0)}

        def body(comm):
            state = members[comm.rank][0]
            without_host_memory = agree(comm, 3 if comm.rank == 0 else -1, state.layout_digest(), comm.rank == 1)
            socket_only = agree(comm, 3 if comm.rank == 0 else -1, state.layout_digest(), comm.rank == 1,
                                same_host_reads=False, state_tensors=state.tensors())
            return (without_host_memory.defer, socket_only.defer, without_host_memory.read_first,
                    socket_only.read_first)

        results, _ = run_ranks(comms, body, timeout=60)
        assert results == [(False, False, False, False)] * 2  # nothing to read first: not deferrable anyway
    finally:
        close_all(comms)


# -- healing over the device plane (tmrun.worker.device_transfer), with an in-process plane -------
class FakePlane:
    """One plane for every member of a test: a stripe sent to a member waits in a mailbox until
    that member's receive takes it. ``takes``: which tracked tensors the plane carries."""

    def __init__(self, takes, tamper=None) -> None:
        import queue
        import threading

        self._boxes: dict = {}
        self._lock = threading.Lock()
        self._queue = queue.Queue
        self.takes_fn = takes
        self.tamper = tamper
        self.ready_calls = 0

    def box(self, src: int, dst: int):
        with self._lock:
            return self._boxes.setdefault((src, dst), self._queue())

    def link(self, rank: int, takes=None):
        return FakeLink(self, rank, takes or self.takes_fn)


class FakeLink:
    def __init__(self, plane: FakePlane, rank: int, takes) -> None:
        self._plane, self._rank, self._takes = plane, rank, takes

    def takes(self, tensor) -> bool:
        return bool(tensor.numel()) and self._takes(tensor)

    def ready(self) -> None:
        self._plane.ready_calls += 1

    def device(self):
        return torch.device("cpu")

    def send(self, views, dst: int) -> None:
        for view in views:
            copy = view.clone()
            if self._plane.tamper is not None:
                self._plane.tamper(copy)
            self._plane.box(self._rank, dst).put(copy)

    def recv(self, views, src: int):
        plane, me = self._plane, self._rank

        class Work:
            def __init__(self, view) -> None:
                self.view = view

            def wait(self) -> None:
                self.view.copy_(plane.box(src, me).get(timeout=30))

        return [Work(view) for view in views]


def _weights_only(tensor) -> bool:  # a mixed state: matrices on the "device", the rest on the host
    return tensor.dim() == 2


@pytest.mark.parametrize("n,needy", [(2, [1]), (3, [1]), (4, [0, 3])])
def test_healing_over_the_device_plane_is_bit_for_bit(n, needy):
    """The plane's tensors go over it, striped over the donors and checksummed; the others take
    the host path; the healed state equals the donors' bit for bit."""
    plane = FakePlane(_weights_only)
    comms = make_group(n, job=f"heal-device{n}")
    try:
        members = {r: make_member(seed=1 if r not in needy else 100 + r, steps=3 if r not in needy else 0)
                   for r in range(n)}

        def body(comm):
            state = members[comm.rank][0]
            fresh = comm.rank in needy
            plan = agree(comm, -1 if fresh else 3, state.layout_digest(), fresh)
            return plan, heal(comm, state, plan, {"committed_step": 3}, device=plane.link(comm.rank))

        results, _ = run_ranks(comms, body, timeout=60)
        plan = results[0][0]
        reference = snapshot(members[plan.donors[0]][0])
        for rank in range(n):
            assert snapshot(members[rank][0]) == reference, f"rank {rank} differs"
        device_bytes = sum(t.numel() * t.element_size() for _, t in members[plan.donors[0]][0].tensors()
                           if _weights_only(t))
        for rank in needy:
            healed = results[rank][1]
            assert sum(healed.paths["device"]) == device_bytes and len(healed.paths["device"]) == len(plan.donors)
            assert healed.nbytes == sum(len(b) for b in reference)
        assert plane.ready_calls == n  # every member made sure the plane's generation exists
    finally:
        close_all(comms)


def _heal_a_joiner_on_the_plane(plane: FakePlane, job: str, joiner_takes=None) -> tuple[dict, list]:
    """Rank 1 (new) heals from rank 0 over ``plane``; ``joiner_takes``: what the joiner's own
    plane takes (default: as the donor's). Returns (members, errors)."""
    comms = make_group(2, job=job)
    try:
        members = {0: make_member(1, 3), 1: make_member(100, 0)}

        def body(comm):
            state = members[comm.rank][0]
            fresh = comm.rank == 1
            plan = agree(comm, -1 if fresh else 3, state.layout_digest(), fresh)
            link = plane.link(comm.rank, takes=joiner_takes if fresh else None)
            return heal(comm, state, plan, {"committed_step": 3}, device=link)

        _, errors = run_ranks(comms, body, timeout=60, raise_errors=False)
        return members, errors
    finally:
        close_all(comms)


def test_optimizer_state_allocated_elsewhere_arrives_through_a_scratch_copy():
    """The joiner's optimizer never stepped: the state it allocates is not where the plane takes
    it (on a GPU: a CPU step counter the donor keeps on the device, or the reverse); the donor's
    choice rules, and the joiner receives into a scratch tensor and copies it over."""
    # the joiner's plane takes nothing of its own: every device tensor goes through scratch
    members, errors = _heal_a_joiner_on_the_plane(FakePlane(_weights_only), "heal-scratch",
                                                   joiner_takes=lambda t: False)
    assert errors == [None, None]
    assert snapshot(members[1][0]) == snapshot(members[0][0])


def test_a_damaged_device_stripe_is_a_transfer_error():
    def flip(copy) -> None:
        copy.view(-1)[0] ^= 1

    _, errors = _heal_a_joiner_on_the_plane(FakePlane(_weights_only, tamper=flip), "heal-device-damaged")
    assert isinstance(errors[1], TransferError) and "checksum mismatch in the device stripe" in str(errors[1])
    assert errors[0] is None  # the donor finished its side


def test_the_device_checksum_sees_a_changed_or_moved_byte():
    from tmrun.worker import device_transfer

    data = torch.arange(100, dtype=torch.uint8)
    base = device_transfer.checksum([data])
    assert base == device_transfer.checksum([data.clone()]) and 0 <= base < 2 ** 32
    changed = data.clone()
    changed[57] ^= 4
    swapped = data.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert device_transfer.checksum([changed]) != base and device_transfer.checksum([swapped]) != base
    assert device_transfer.checksum([data[:40], data[40:]]) == base  # where the views split does not matter
    assert device_transfer.checksum([]) == 0


@pytest.mark.parametrize("asking", [[], [1], [0, 2]])
def test_every_member_resets_its_ddp_reducers_when_any_needs_it(asking):
    """A member whose DDP reducer must be reset (a stopped backward) makes every member reset:
    DDP then rebuilds its buckets, with a broadcast, on all of them in the same step."""
    comms = make_group(3, job="reset-agree")
    try:
        members = {r: make_member(1, 3) for r in range(3)}

        def body(comm):
            state = members[comm.rank][0]
            return agree(comm, 3, state.layout_digest(), False, reset_models=comm.rank in asking)

        plans, _ = run_ranks(comms, body, timeout=60)
        assert [plan.reset_models for plan in plans] == [bool(asking)] * 3
    finally:
        close_all(comms)

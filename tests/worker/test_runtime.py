"""The runtime facade in a plain job (one process, torchrun's variables): the public API, DDP
through comm.ddp.wrap, the optimizer guarded on the user's object and as a wrapper, the role."""

from __future__ import annotations

import pytest

import socket
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    import tmrun
    from tmrun.worker.optimizer import GuardedOptimizer, guarded_in_place
    from tmrun.worker.roles import Role

    tm = tmrun.init()
    assert tmrun.init() is tm
    assert (tm.rank, tm.world_size, tm.local_rank) == (0, 1, 0)
    assert not tm.is_standby and not tm.is_shadow and not tm.in_place and not tm.aborted
    assert tm.role is Role.ACTIVE and tm.committed_step == -1 and tm.recoveries == []
    assert dist.get_backend() == BACKEND
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = tm.ddp(model)
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    tm.track(model=ddp, optimizer=opt, seen=0)
    assert guarded_in_place(opt) and type(opt) is torch.optim.SGD
    wrapped = tm.optimizer(opt)
    assert isinstance(wrapped, GuardedOptimizer) and wrapped.optimizer is opt
    for step in tm.steps(3):
        ddp(torch.ones(2, 4)).sum().backward()
        (opt if step < 2 else wrapped).step()
        opt.zero_grad()
        assert tm.committed_step == step
        tm.values["seen"] += 1
    assert tm.values["seen"] == 3 and tm.committed_step == 2
    # tm.aborted (the step is yielded again) and tm.void (its collectives' values are void)
    ctx = tm._ctx
    ctx.current_step, ctx.aborted_by = 3, 1  # a loss before step 3's update: redone, void
    assert tm.aborted and tm.void
    ctx.committed_step = 3  # a loss after step 3's update: committed, void, not redone
    assert tm.void and not tm.aborted
    ctx.aborted_by = None
    assert not tm.void and not tm.aborted
    # tm.voided_step: step 3's tail was void; seen in the step after it (redone or not), and after
    # the loop when it was the last, never in step 3 itself nor once a later step committed
    assert tm.voided_step is None
    ctx.void_tail, ctx.loop_finished = 3, False  # (as in the loop)
    assert tm.voided_step is None  # still in step 3
    ctx.current_step = 4
    assert tm.voided_step == 3
    ctx.committed_step = 4
    assert tm.voided_step is None  # step 4 committed: its start redid the tail
    ctx.committed_step, ctx.current_step, ctx.loop_finished = 3, 3, True
    assert tm.voided_step == 3  # the last step's tail: after the loop
    ctx.void_tail, ctx.loop_finished = None, False
    assert tm.voided_step is None
    tm.refuse_in_place("a set-up tmrun cannot follow")  # under plain torchrun: nothing to refuse, no error
    # tm.tolerate_void: an Exception in its block is swallowed while the step is void, else raised
    ctx.aborted_by = 1
    with tm.tolerate_void("the save"):
        raise EOFError("Ran out of input")
    ctx.aborted_by = None
    try:
        with tm.tolerate_void("the save"):
            raise EOFError("not void")
    except EOFError:
        pass
    else:
        raise AssertionError("an error outside a void step must propagate")
    ctx.committed_step = 2
    try:
        tm.migrate()
    except RuntimeError as exc:
        assert "standby" in str(exc)
    else:
        raise AssertionError("migrate without a standby must fail")
    dist.destroy_process_group()
    print("ok")
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(backend: str) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "TMRUN_BACKEND": backend, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", f"BACKEND = {backend!r}\n" + SCRIPT], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


@pytest.mark.e2e  # starts processes that import torch: not in the unit subset
def test_plain_job_over_tmrun() -> None:
    _run("tmrun")


@pytest.mark.e2e  # starts processes that import torch: not in the unit subset
def test_plain_job_over_gloo() -> None:
    """A plain worker group of another backend: tm.ddp builds DDP over it too."""
    _run("gloo")

"""One rank of a multi-process test of torch's parallel APIs over a backend ("tmrun" or "gloo").

    python mesh_worker.py SCENARIO --backend B --rank R --world N --port P

Prints JSON lines on stdout ({"event": ...}); the last one is {"event": "ok", ...} with what
the test compares across backends (digests of results / of this rank's local state). Scenarios:

* groups: dist.new_group (several, overlapping, a rank outside some) and dist.split_group;
  allreduce / allgather / reduce_scatter / broadcast / all_to_all on each.
* mesh: init_device_mesh("cpu", (2, 2)) with ("replicate", "shard") and ("dp", "tp"): the
  dimension groups' ranks and a reduction along each.
* fsdp: FSDP2 fully_shard on a 1-D mesh of all ranks; a few AdamW steps of a tiny GPT.
* hsdp: fully_shard on a 2-D ("replicate", "shard") mesh (HSDP).
* tp: ColwiseParallel / RowwiseParallel on the "tp" dim of a ("dp", "tp") mesh, gradients
  averaged over "dp".
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import hashlib
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tmrun  # noqa: E402,F401  (registers the backend)
import tiny_gpt as gpt  # noqa: E402  (examples/tiny_gpt.py)

TIMEOUT = datetime.timedelta(seconds=60)
STORE = None  # this process's TCPStore


def say(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def hexdigest(tensors) -> str:
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(gpt._bytes(t))
    return sha.hexdigest()


def data(seed: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# ------------------------------------------------------------------------------------- groups
def scenario_groups(args) -> dict:
    r, n = args.rank, args.world
    out: list[torch.Tensor] = []
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank calls every new_group
    evens = dist.new_group([0, 2])
    mine = halves[r // 2]
    assert dist.get_world_size(mine) == 2 and dist.get_rank(mine) == r % 2
    assert (dist.get_rank(evens) == r // 2) if r % 2 == 0 else dist.get_rank(evens) == -1
    for g in (mine, evens) if r % 2 == 0 else (mine,):
        gn = dist.get_world_size(g)
        t = data(10 + r, 6)
        dist.all_reduce(t, group=g)
        out.append(t)
        t = data(20 + r, 5)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        out.append(t)
        gathered = [torch.empty(3) for _ in range(gn)]
        dist.all_gather(gathered, data(30 + r, 3), group=g)
        out += gathered
        big = torch.empty(3 * gn)
        dist.all_gather_into_tensor(big, data(40 + r, 3), group=g)
        out.append(big)
        rs = torch.empty(4)
        dist.reduce_scatter_tensor(rs, data(50 + r, 4 * gn), group=g)
        out.append(rs)
        b = data(60 + r, 4)
        dist.broadcast(b, src=dist.get_global_rank(g, gn - 1), group=g)
        out.append(b)
        a2a = torch.empty(2 * gn)
        dist.all_to_all_single(a2a, data(70 + r, 2 * gn), group=g)
        out.append(a2a)
        dist.barrier(group=g)
    # split_group: on a host without an accelerator torch 2.13 refuses it for every backend
    # (it splits the accelerator's backend of a group bound to a device): record what it says
    try:
        split = dist.split_group(split_ranks=[[0, 3], [1, 2]], group_desc="pairs")
        t = data(80 + r, 7)
        dist.all_reduce(t, group=split)
        out.append(t)
        split_error = ""
    except RuntimeError as exc:
        split, split_error = None, str(exc)
    names = sorted({g.group_name for g in (mine, evens, split) if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER})
    return {"digest": hexdigest(out), "groups": names, "n": n, "split_error": split_error}


# ------------------------------------------------------------------------------------- mesh
def scenario_mesh(args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    r = args.rank
    out: list[torch.Tensor] = []
    info = {}
    for names in (("replicate", "shard"), ("dp", "tp")):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        for dim in names:
            g = mesh.get_group(dim)
            ranks = dist.get_process_group_ranks(g)
            info[dim] = ranks
            assert r in ranks and mesh.get_local_rank(dim) == ranks.index(r)
            t = data(100 + r, 5)
            dist.all_reduce(t, group=g)
            out.append(t)
            big = torch.empty(4)
            dist.all_gather_into_tensor(big, data(110 + r, 2), group=g)
            out.append(big)
        info[f"backend_{names[0]}"] = dist.get_backend(mesh.get_group(names[0]))
    return {"digest": hexdigest(out), "ranks": info}


# ------------------------------------------------------------------------------------- fsdp / hsdp
def _train(model: torch.nn.Module, cfg: gpt.GPTConfig, dp_rank: int, steps: int) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        idx, target = gpt.batch(step, dp_rank, cfg)
        loss = gpt.loss_of(model, idx, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def _sharded(mesh, cfg: gpt.GPTConfig) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


SAVE = ""  # --save: rank 0 writes the full parameters there (torch.save)


def _shard_key(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Which shard this rank holds, as the runtime's healing sees it (docs/mesh.md)."""
    from tmrun.worker.tracked import TrackedState

    tracked = TrackedState()
    tracked.track(model=model, optimizer=opt)
    return tracked.shard_key()


def _full_digest(model: torch.nn.Module) -> str:
    """The full parameters (a collective: every rank gathers them), for the reference check."""
    full = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for k, p in model.state_dict().items()}
    if SAVE and dist.get_rank() == 0:
        torch.save(full, SAVE)
    return hexdigest(full.values())


def scenario_fsdp(args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    cfg = gpt.GPTConfig()
    mesh = init_device_mesh("cpu", (args.world,))
    model = _sharded(mesh, cfg)
    opt = _train(model, cfg, args.rank, args.steps)
    return {"digest": gpt.digest(model, opt), "full": _full_digest(model), "shard_key": _shard_key(model, opt)}


def scenario_hsdp(args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    cfg = gpt.GPTConfig()
    mesh = init_device_mesh("cpu", (2, args.world // 2), mesh_dim_names=("replicate", "shard"))
    model = _sharded(mesh, cfg)
    opt = _train(model, cfg, args.rank, args.steps)
    return {"digest": gpt.digest(model, opt), "full": _full_digest(model), "shard_key": _shard_key(model, opt)}


# ------------------------------------------------------------------------------------- tp
def scenario_tp(args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg = gpt.GPTConfig()
    mesh = init_device_mesh("cpu", (2, args.world // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    plan = {}
    for i in range(cfg.layers):
        plan[f"blocks.{i}.mlp.up"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.down"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    dp = mesh.get_group("dp")
    dp_rank = mesh.get_local_rank("dp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(args.steps):
        idx, target = gpt.batch(step, dp_rank, cfg)
        gpt.loss_of(model, idx, target).backward()
        for p in model.parameters():
            g = gpt.local(p.grad)
            dist.all_reduce(g, group=dp)
            g.div_(dist.get_world_size(dp))
        opt.step()
        opt.zero_grad()
    return {"digest": gpt.digest(model, opt), "full": _full_digest(model), "shard_key": _shard_key(model, opt)}


# ------------------------------------------------------------------------------------- sandbox
def scenario_sandbox(args) -> dict:
    """A standby's sandbox (tmrun.worker.group.init_local: the default group in local mode, no
    store, no peer): the mesh's subgroups are created local too, and FSDP2/HSDP steps run with
    every collective served locally; tm.track sees the DTensors' local shards."""
    from torch.distributed.device_mesh import init_device_mesh

    from tmrun.comm import backend as tb
    from tmrun.worker import group
    from tmrun.worker.tracked import TrackedState

    cfg = gpt.GPTConfig()
    mesh = init_device_mesh("cpu", (2, args.world // 2), mesh_dim_names=("replicate", "shard"))
    model = _sharded(mesh, cfg)
    opt = _train(model, cfg, 0, 2)
    groups = tb.created_groups()
    tracked = TrackedState()
    tracked.track(model=model, optimizer=opt)
    tensors = tracked.tensors()
    return {"traffic": group.traffic(), "groups": [(g.getGroupName(), g.size(), g.local) for g in groups],
            "dtensors": sum(hasattr(t, "to_local") for _, t in tensors),
            "shapes": {n: list(t.shape) for n, t in tensors if n.endswith("blocks.0.mlp.up.weight")},
            "finite": all(bool(torch.isfinite(t).all()) for _, t in tensors if t.is_floating_point())}


# ------------------------------------------------------------------------------------- regroup
REGROUP_STEPS = 6


def _regroup_groups() -> list:
    """The job's subgroups, created in the same order by every rank and by a joiner."""
    return [dist.new_group([0, 1]), dist.new_group([2, 3]), dist.new_group([0, 2]), dist.new_group([1, 3])]


def _regroup_steps(r: int, groups: list, first: int, results: list) -> None:
    mine = [None] + [g for g in groups if r in dist.get_process_group_ranks(g)]  # None: the default group
    for step in range(first, REGROUP_STEPS):
        for i, g in enumerate(mine):
            t = data(1000 * step + 10 * r + i, 5)
            dist.all_reduce(t, group=g)
            results.append(t)


def scenario_regroup(args) -> dict:
    """Rank 3 leaves after step K (--kill-step; 0: a reference run without it) while every rank
    is between steps; the survivors repair the default group and every subgroup that holds rank
    3, in creation order (TmrunProcessGroup.prepare_replacement + commit), and a joiner (--standby)
    takes rank 3 by creating the same groups in join mode (tmrun.comm.backend.set_joining). The
    results of the steps from K on must equal the reference run's, rank by rank."""
    from tmrun.comm import backend as tb

    r, k = args.rank, args.kill_step
    results: list = []
    if args.standby:  # the joiner: nothing of the job exists in this process before its assignment
        key = "regroup/assign"
        STORE.wait([key], datetime.timedelta(seconds=60))
        gen = int(STORE.get(key))
        tb.set_joining(gen)
        dist.init_process_group("tmrun", store=STORE, rank=r, world_size=args.world, timeout=TIMEOUT)
        groups = _regroup_groups()
        tb.set_joining(None)
        _regroup_steps(r, groups, k, results)
        return {"digest": hexdigest(results), "commits": _commits(r, groups)}
    groups = _regroup_groups()
    first = 0
    if k:
        _regroup_steps(r, groups, 0, [])  # steps 0 .. K-1 (before the change: not compared)
        first = k
        dist.barrier()
        if r == 3:
            os._exit(0)  # leaves between steps (the survivors know whom to replace: no detection here)
        if r == 0:
            STORE.set("regroup/assign", "1")
        for g in [dist.group.WORLD] + groups:  # creation order: the joiner's order
            ranks = dist.get_process_group_ranks(g)
            if r in ranks and 3 in ranks:
                pg = tb.get_group(g)
                pg.prepare_replacement([ranks.index(3)], 1)
                pg.comm.commit()
                pg.clear_aborted()
    results = []
    _regroup_steps(r, groups, first, results)
    if not k:  # the reference: only the steps from --compare-from on count
        results = results[-len(results) * (REGROUP_STEPS - args.compare_from) // REGROUP_STEPS:]
    return {"digest": hexdigest(results), "commits": _commits(r, groups)}


def scenario_resync(args) -> dict:
    """A subgroup that lost nobody, resynchronised in a recovery (docs/mesh.md, section 2): rank
    1 aborted the step before it issued a collective on the group (served locally), rank 0
    issued it and waits for rank 1's part, which never comes. Rank 1 moves the group to
    generation 1 (prepare with nobody replaced, commit); its switch ends rank 0's collective
    (absorbed by rank 0's failure handler), rank 0 switches too, and the group works again."""
    import time

    from tmrun.comm import backend as tb

    r = args.rank
    g = dist.new_group([0, 1])
    pg = tb.get_group(g)
    absorbed: list = []
    pg.set_failure_handler(lambda exc: absorbed.append(f"{type(exc).__name__}: {exc}") or True)
    t = data(10 + r, 4)
    dist.all_reduce(t, group=g)  # generation 0 works
    stuck_for = 0.0
    if r == 0:
        work = dist.all_reduce(data(20, 4), group=g, async_op=True)  # rank 1 never issues it
        time.sleep(1.0)
        assert not work.is_completed(), "the collective completed without rank 1's part"
        started = time.monotonic()
        pg.prepare_replacement([], 1)
        pg.comm.commit()  # queued behind the stuck collective: returns once rank 1's switch ended it
        work.wait()
        stuck_for = time.monotonic() - started
    else:
        pg.abort_collectives()  # this rank's step was aborted: its collective is served locally
        dist.all_reduce(data(21, 4), group=g)
        time.sleep(2.0)  # rank 0 waits in its collective meanwhile
        pg.prepare_replacement([], 1)
        pg.comm.commit()
    pg.clear_aborted()
    after = data(30 + r, 4)
    dist.all_reduce(after, group=g)
    expect = data(30, 4) + data(31, 4)
    return {"same": bool(torch.equal(after, expect)), "absorbed": absorbed, "stuck_for": stuck_for,
            "commits": pg.counters()["commits"]}


def _commits(r: int, groups: list) -> list:
    """Per group of this rank (the default group first, then in creation order): its ranks and
    how many replacements its communicator committed."""
    from tmrun.comm import backend as tb

    mine = [dist.group.WORLD] + [g for g in groups if r in dist.get_process_group_ranks(g)]
    return [[dist.get_process_group_ranks(g), tb.get_group(g).counters()["commits"]] for g in mine]


SCENARIOS = {"resync": scenario_resync, "regroup": scenario_regroup, "sandbox": scenario_sandbox, "groups": scenario_groups, "mesh": scenario_mesh, "fsdp": scenario_fsdp, "hsdp": scenario_hsdp,
             "tp": scenario_tp}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", help="one of " + ", ".join(sorted(SCENARIOS)) + ", or several joined by commas "
                   "(run one after another, each in a process group of its own; the result per scenario)")
    p.add_argument("--backend", default="tmrun")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--watchdog", type=float, default=90.0, help="dump every thread's stack and exit after S s")
    p.add_argument("--save", default="")
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--compare-from", type=int, default=0)
    p.add_argument("--standby", action="store_true")
    args = p.parse_args()
    names = args.scenario.split(",")
    if any(name not in SCENARIOS for name in names) or (len(names) > 1 and {"regroup", "sandbox"} & set(names)):
        p.error(f"unknown or unsupported scenario list {args.scenario!r}")
    global SAVE
    SAVE = args.save
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    torch.set_num_threads(1)
    try:
        global STORE
        if args.scenario == "regroup" and args.standby:
            STORE = dist.TCPStore("127.0.0.1", args.port, None, False, timeout=TIMEOUT)
        elif args.scenario == "sandbox":
            from tmrun.worker import group

            group.init_local(args.world)
        else:
            STORE = dist.TCPStore("127.0.0.1", args.port, None, args.rank == 0, timeout=TIMEOUT,
                                  wait_for_workers=False)
        if len(names) > 1:  # several scenarios, one process group each (one process start for all)
            results = {}
            for index, name in enumerate(names):
                dist.init_process_group(args.backend, store=dist.PrefixStore(f"scenario{index}", STORE),
                                        rank=args.rank, world_size=args.world, timeout=TIMEOUT)
                results[name] = SCENARIOS[name](args)
                dist.barrier()
                dist.destroy_process_group()
            say(event="ok", rank=args.rank, scenarios=results)
            return 0
        if args.scenario not in ("regroup", "sandbox") or (args.scenario == "regroup" and not args.standby):
            if not dist.is_initialized():
                dist.init_process_group(args.backend, store=STORE, rank=args.rank, world_size=args.world,
                                        timeout=TIMEOUT)
        result = SCENARIOS[args.scenario](args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        say(event="failed", error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc())
        return 1
    say(event="ok", rank=args.rank, **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

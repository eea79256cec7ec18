"""torchtitan, one worker SIGKILLed at a random moment: tmrun in place vs torchrun restarting from torchtitan's DCP checkpoint.

The job: torchtitan's own trainer code (0.3.0) on its llama3 debug model, on CPU (the test-only
shim, offline tokenizer and data of tests/titan/), float32, 128 tokens x 2 per rank, seeded;
by default the DDP-like layout (``--parallelism.data_parallel_replicate_degree 2``: FSDP2 over
a 2 x 1 mesh, every parameter replicated) on 2 processes, with ``--layout hsdp`` HSDP 2 x 2 on 4,
with ``--layout tp_dp`` TP 2 x DP 2 on 4; ``--compile`` adds torchtitan's ``--compile.enable`` under
both launchers (a restarted torchrun group compiles again in every process, a tmrun joiner in
its own: dynamo folds the rank into its graphs, tmrun/worker/compiled_code.py).
``OMP_NUM_THREADS=1``. The same steps under both launchers, interleaved run by run in one
invocation (the ``--module`` configs are tests/titan/bench_config.py's):

* torchrun: ``python -m torch.distributed.run --standalone --nproc-per-node N --max-restarts 3``
  with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torchrun's reliable setting), torchtitan's own
  ``Trainer`` (``--config titan_bench_plain``, no tmrun) with torchtitan's checkpointing on:
  ``--checkpoint.enable --checkpoint.interval C --checkpoint.folder DIR`` (DCP: model,
  optimizer, LR schedulers, data loader, train state). After the kill torchrun restarts the
  worker group, which resumes from the last checkpoint;
* tmrun: ``tmrun --standalone --nproc-per-node N --standby 1`` with the integration's trainer
  (``--config titan_bench_tmrun``: tmrun.integrations.torchtitan), no checkpoint: the standby,
  warm in its shadow steps, takes the lost rank in place, healed from the survivors' memory.

The kill (``random.Random(--seed)``, drawn once per run index, the same for both launchers): a
step S (torchtitan's 1-based step) uniformly from C + 1 .. steps - 3 (so a checkpoint exists
before it and steps follow it) and a fraction u of a step. Once (tmrun) the standby said it is
warm and rank 1 logged the completion of step S - 1, the bench sleeps u x rank 1's steady step
and SIGKILLs rank 1's process from outside, by the PID its step log names (checked to be this
job's); t_kill = ``time.time()`` right after it. A kill at a checkpoint step's end may fall in
torchrun's checkpoint save: that is part of a random moment.

From rank 0's step log (one line per completed step: step, unix time, pid), with the arithmetic
of bench/random_kill.py (``kill_metrics``, imported):

* steady: the median interval of the (up to) 8 completions before the kill;
* downtime = (t_next - t_last) - steady: the largest gap between completed steps around the
  kill (t_last: the last completion before the kill) minus one steady step;
* kill -> next step = (t_next - t_kill) - steady;
* committed time lost: when rank 0 completes the step in flight again, minus (t_last + steady):
  torchrun's includes its restart and the steps recomputed since its checkpoint;
* steps recomputed: steps completed before the kill that rank 0 completed again.

A run counts as recovered when the launcher exits 0, rank 0 completed the last step, the kill's
figures could be computed and (tmrun) the agent logged an in-place replacement with rank 0 in
the same process, (torchrun) torchtitan loaded a checkpoint. Every run writes each rank's final
digest (local model shards, buffers, optimizer state, learning rates); the bench checks that
every run of both launchers ends with the same bits (a resume that was not exact would differ).

Processes are tagged and cleaned up as in bench/inplace_failover.py (whose helpers this bench
imports), also on Ctrl-C; every wait is bounded (``--timeout`` per run). Needs torchtitan
(``pip install -e '.[torchtitan]'``); ``--help`` imports neither torch nor torchtitan.

    python bench/torchtitan_failover.py                    # --runs 3, 20 steps: about 8 minutes on 2 cores
    python bench/torchtitan_failover.py --runs 1           # smoke run
    python bench/torchtitan_failover.py --layout hsdp      # HSDP 2 x 2, 4 processes (+ 1 standby)
    python bench/torchtitan_failover.py --layout tp_dp --compile   # TP x DP, compiled
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers of the other benches
from inplace_failover import (  # noqa: E402
    STEADY_WINDOW,
    base_env,
    machine,
    print_notes,
    read_steps,
    steady_step,
)
from random_kill import KillMetrics, last_line  # noqa: E402
from hsdp_failover import (  # noqa: E402  (the same flags' errors, summaries, and run under watch)
    Abort,
    OneLineParser,
    conclude,
    digests_agree,
    judge,
    kill_logged_rank,
    print_tables,
    run_all,
    spread,
    start_watched,
    step_done,
    wind_up,
)

ROOT = Path(__file__).resolve().parent.parent
CONFIG_MODULE = "tests.titan.bench_config"
LAUNCHERS = ("torchrun", "tmrun")
# layout name -> (processes, torchtitan's parallelism flags); as tests/e2e/test_torchtitan.py
LAYOUTS = {
    "ddp": (2, ["--parallelism.data_parallel_replicate_degree", "2"]),
    "hsdp": (4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
    "tp_dp": (4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                  "--parallelism.tensor_parallel_degree", "2"]),
}
LAYOUT_NAMES = {
    "ddp": "DDP-like (`--parallelism.data_parallel_replicate_degree 2`)",
    "hsdp": "HSDP 2 x 2 (`data_parallel_replicate_degree 2`, `data_parallel_shard_degree 2`)",
    "tp_dp": "TP 2 x DP 2 (`tensor_parallel_degree 2`, `data_parallel_replicate_degree 2`)",
}
NAN = float("nan")
POLL = 0.05
FAST_POLL = 0.005  # while waiting for rank 1's step S - 1 (the kill's reference point)
KILL_RANK = 1
STEADY_MIN = 3  # completions before the kill: the steady step needs a few intervals


# -- flags and pure arithmetic (unit tested: tests/bench/test_torchtitan_bench.py) ----------------


def kill_range(steps: int, checkpoint_every: int) -> tuple[int, int]:
    """The steps (1-based, inclusive) a kill may land in: after torchrun's first checkpoint and
    STEADY_MIN completions, with 3 steps after it."""
    return max(checkpoint_every + 1, STEADY_MIN + 2), steps - 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(prog="torchtitan_failover.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs per launcher, interleaved (default 3)")
    parser.add_argument("--layout", default="ddp",
                        help="ddp (2 processes, default), hsdp (2 x 2, 4 processes) "
                             "or tp_dp (TP 2 x DP 2, 4 processes)")
    parser.add_argument("--compile", action="store_true",
                        help="torchtitan's --compile.enable (blocks and loss compiled) under both launchers")
    parser.add_argument("--async-checkpoint", action="store_true",
                        help="both launchers save torchtitan's checkpoint every --checkpoint-every steps with "
                             "--checkpoint.async_mode async (tmrun: heals in place all the same)")
    parser.add_argument("--steps", type=int, default=20, help="torchtitan steps per run (default 20)")
    parser.add_argument("--checkpoint-every", type=int, default=5,
                        help="torchrun's torchtitan --checkpoint.interval (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill steps and moments (default 0)")
    parser.add_argument("--launchers", default="torchrun,tmrun", help="which launchers (default both)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take (default 300)")
    parser.add_argument("--keep", action="store_true", help="keep the logs (printed folder)")
    args = parser.parse_args(argv)
    args.launchers = [s.strip() for s in args.launchers.split(",") if s.strip()]
    low, high = kill_range(args.steps, max(1, args.checkpoint_every))
    problems = [
        (args.runs < 1, "--runs must be at least 1"),
        (args.layout not in LAYOUTS, f"unknown --layout {args.layout!r} (ddp, hsdp, tp_dp)"),
        (args.checkpoint_every < 1, "--checkpoint-every must be at least 1"),
        (low > high, f"--steps must be at least {low + 3} with --checkpoint-every {args.checkpoint_every} "
                     "(a checkpoint and a steady step before the kill, 3 steps after it)"),
        (not args.launchers, "--launchers names none"),
        (args.timeout <= 0, "--timeout must be positive"),
    ]
    for launcher in args.launchers:
        problems.append((launcher not in LAUNCHERS, f"unknown launcher {launcher!r} (torchrun, tmrun)"))
    for bad, message in problems:
        if bad:
            parser.error(message)
    return args


def kill_plan(seed: int, runs: int, steps: int, checkpoint_every: int) -> list[tuple[int, float]]:
    """Per run index: (the step the kill lands in, 1-based; the fraction of a steady step after
    rank 1 completed the step before), the same for every launcher."""
    rng = random.Random(seed)
    low, high = kill_range(steps, checkpoint_every)
    return [(rng.randint(low, high), rng.random()) for _ in range(runs)]


# -- one run --------------------------------------------------------------------------------------


@dataclass
class Run:
    launcher: str
    index: int
    kill_step: int
    fraction: float
    ok: bool = False
    metrics: KillMetrics | None = None
    recovery: float = NAN  # tmrun: the controller's "all ranks recovered, X s after"
    phases: dict[str, float] = field(default_factory=dict)  # tmrun: the recovered event's (docs/events.md)
    resumed: int = -1  # torchrun: the step of the checkpoint torchtitan loaded
    finals: list[str] = field(default_factory=list)
    others: float = NAN  # CPU cores other processes kept busy meanwhile
    seconds: float = NAN
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        text = (f"{self.launcher} run {self.index} (kill in step {self.kill_step} + {self.fraction:.2f} steady): "
                f"{'recovered' if self.ok else 'FAILED'}")
        m = self.metrics
        if m is not None:
            text += (f", steady {m.steady:.3f}s, downtime {m.downtime:.3f}s, kill -> next step {m.stall:.3f}s, "
                     f"committed lost {m.committed:.3f}s, recomputed {m.recomputed}")
        if self.resumed >= 0:
            text += f", resumed from step {self.resumed}"
        if not math.isnan(self.recovery):
            text += f", tmrun recovery {self.recovery:.3f}s"
        text += f" ({self.seconds:.0f}s, others {self.others:.2f} cores)"
        return text + (f" [{'; '.join(self.notes)}]" if self.notes else "")


def command(args: argparse.Namespace, launcher: str, work: Path, assets: Path) -> tuple[list[str], dict[str, str]]:
    nproc, flags = LAYOUTS[args.layout]
    config = "titan_bench_tmrun" if launcher == "tmrun" else "titan_bench_plain"
    titan = ["-m", "torchtitan.train", "--module", CONFIG_MODULE, "--config", config, *flags,
             *(["--compile.enable"] if args.compile else []), "--training.steps", str(args.steps)]
    env = dict(base_env(), TITAN_TEST_ASSETS=str(assets), TITAN_TEST_OUT=str(work), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", str(args.checkpoint_every),
                  "--checkpoint.folder", str(work / "checkpoint"),
                  *(["--checkpoint.async_mode", "async"] if args.async_checkpoint else [])]
    if launcher == "tmrun":
        cmd = [sys.executable, "-m", "tmrun.cli.main", "--standalone", "--nproc-per-node", str(nproc),
               "--standby", "1", "--console", "plain", *titan, *(checkpoint if args.async_checkpoint else [])]
        return cmd, dict(env, TMRUN_STATE_DIR=str(work / "state"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "3", *titan, *checkpoint]
    return cmd, dict(env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def one_run(args: argparse.Namespace, launcher: str, index: int, plan: tuple[int, float], work: Path,
            assets: Path) -> Run:
    kill_step, fraction = plan
    run = Run(launcher, index, kill_step, fraction)
    nproc = LAYOUTS[args.layout][0]
    log = work / "launcher.log"
    rank0, rank1 = work / "steps-0.log", work / f"steps-{KILL_RANK}.log"
    cmd, env = command(args, launcher, work, assets)
    job, watch, started = start_watched(cmd, log, env, launcher == "tmrun", args.timeout)
    t_kill = NAN
    code: int | None = None
    try:
        try:
            watch.standby_warm()
            watch.wait_for(f"rank {KILL_RANK}'s step {kill_step - 2}", lambda: step_done(rank1, kill_step - 2))
            watch.wait_for(f"rank {KILL_RANK}'s step {kill_step - 1}", lambda: step_done(rank1, kill_step - 1),
                           poll=FAST_POLL)
            line = last_line(rank1)
            steady = steady_step([t for _, t, _ in read_steps(rank1)][-(STEADY_WINDOW + 1):])
            # a fraction of a steady step into step S
            t_kill = kill_logged_rank(job, line, at=float(line[1]) + fraction * steady)
            if int(line[0]) != kill_step - 1:
                run.notes.append(f"killed after rank {KILL_RANK}'s step {line[0]}, not {kill_step - 1}")
            code = watch.finish(args.timeout)
        except Abort as exc:
            run.notes.append(str(exc))
    finally:
        wind_up(job, run, started)
    text = log.read_text(errors="replace")
    problems = judge(run, code, read_steps(rank0), t_kill, text, args.steps)
    if launcher != "tmrun":
        loaded = re.search(r"Loading the checkpoint from \S*step-(\d+)", text)
        if loaded:
            run.resumed = int(loaded.group(1))
        else:
            problems.append("torchtitan loaded no checkpoint")
    conclude(run, problems, [work / f"final-{rank}" for rank in range(nproc)])
    return run


def report(args: argparse.Namespace, runs: list[Run], total: float) -> None:
    nproc = LAYOUTS[args.layout][0]
    import torchtitan

    print()
    print("Command: " + " ".join(["python", "bench/torchtitan_failover.py", *sys.argv[1:]]))
    print(f"Machine: {machine()}, torchtitan {getattr(torchtitan, '__version__', '?')}; total {total:.0f} s")
    print(f"Other processes on the machine (not this bench's) kept {spread([r.others for r in runs])} CPU cores "
          "busy during a run (min / median / max).")
    print()
    layout = LAYOUT_NAMES[args.layout] + (", compiled (`--compile.enable`: each block and the loss)"
                                          if args.compile else "")
    kills = ", ".join(f"{r.kill_step} + {r.fraction:.2f}" for r in runs if r.launcher == args.launchers[0])
    print(f"torchtitan's llama3 debug model on CPU, {layout}, {nproc} processes, {args.steps} steps; "
          f"rank {KILL_RANK} SIGKILLed from outside at a random moment (seed {args.seed}; per run: step + "
          f"fraction of a steady step after rank {KILL_RANK} completed the step before: {kills}). torchrun: "
          "`--max-restarts 3`, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, torchtitan's Trainer with "
          f"`--checkpoint.enable --checkpoint.interval {args.checkpoint_every}`"
          f"{' --checkpoint.async_mode async' if args.async_checkpoint else ''}; tmrun: `--standby 1` "
          "(warm at the kill), tmrun.integrations.torchtitan, "
          f"{'the same asynchronous checkpoint' if args.async_checkpoint else 'no checkpoint'}. Seconds, "
          "min / median / max over the recovered runs.")
    print_tables(args.launchers, runs)
    agree = digests_agree([r.finals for r in runs if r.ok])
    print()
    if agree is None:
        print("Final state: fewer than 2 recovered runs, nothing to compare.")
    elif agree:
        print("Final state: every recovered run of both launchers ended with the same per-rank digests "
              "(local model shards, buffers, optimizer state, learning rates).")
    else:
        print("Final state: the recovered runs' per-rank digests DIFFER (a recovery was not exact): "
              + "; ".join(f"{r.launcher} run {r.index}: {','.join(f[:12] for f in r.finals)}" for r in runs if r.ok))
    print_notes([f"{r.launcher} run {r.index}: {'; '.join(r.notes)}" for r in runs if r.notes])


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.path.insert(0, str(ROOT))
    from tests.titan.assets import make_assets

    root = Path(tempfile.mkdtemp(prefix="tmrun-titan-bench-"))
    assets = root / "assets"
    make_assets(assets)
    plan = kill_plan(args.seed, args.runs, args.steps, args.checkpoint_every)
    run_all(args, root, lambda launcher, index, work: one_run(args, launcher, index, plan[index], work, assets),
            report)


if __name__ == "__main__":
    main()

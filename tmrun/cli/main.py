"""``tmrun``: torchrun's command line (every option, both spellings) plus tmrun's options.

The parser is torch's own ``torch.distributed.run.get_args_parser()``, extended: so the options,
defaults and meanings are exactly torchrun's for the installed torch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
import warnings
from collections.abc import Sequence
from typing import NoReturn

from tmrun.cli.slurm import HostlistError, SlurmStepError, node_address, slurm_defaults
from tmrun.console import fail, warn
from tmrun.protocol import environment

ETCD_BACKEND = "tmrun-etcd"  # the tmrun rendezvous on etcd (no store host; the leader is a lease)
TMRUN_BACKENDS = ("tmrun", ETCD_BACKEND)


class UsageError(Exception):
    """A mistake on the command line: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    torch_parser = get_args_parser()
    parser = _Parser(
        prog="tmrun",
        description="torchrun with warm standby members: every torchrun option works, plus the tmrun options below.",
        formatter_class=torch_parser.formatter_class,
        allow_abbrev=False,
    )
    # Re-home torch's actions (same option strings, defaults and help) into our parser,
    # optionals first so tmrun's options can sit before the positional script.
    for action in torch_parser._actions:  # noqa: SLF001 - argparse has no public iterator
        if isinstance(action, argparse._HelpAction):  # noqa: SLF001
            continue
        if action.option_strings:
            parser._add_action(action)  # noqa: SLF001
    group = parser.add_argument_group("tmrun")
    group.add_argument(
        "--standby",
        type=int,
        default=0,
        metavar="N",
        help="Spare members kept warm: standby nodes (the agents beyond --nnodes) when the job spans "
        "nodes, standby worker processes on a single node. Default 0.",
    )
    group.add_argument(
        "--standby-wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="In-place jobs: how long a failure waits for a warm standby before tmrun falls back to "
        "restarting the worker group (as torchrun). Default 60.",
    )
    group.add_argument(
        "--standby-refill-delay",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="One node: after a recovery, wait this long before starting the replacement standby, so "
        "that its warm-up does not slow the joiner's first steps. Default 5.",
    )
    group.add_argument(
        "--hang-timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="In-place jobs (--standby, worker API): when no rank completes a step for this long, the rank that hangs "
        "(a stopped process, or one stuck outside the collective the others wait in) is stopped and "
        "replaced by a standby. Counted from the first step every rank completed. Default 0 (off).",
    )
    group.add_argument(
        "--straggler-factor",
        type=float,
        default=0.0,
        metavar="F",
        help="In-place jobs (--standby, worker API): a rank whose own work per step (outside collectives) exceeds F "
        "times the other ranks' median for --straggler-steps consecutive steps is migrated to a "
        "standby while training goes on. Default 0 (off); e.g. 2.",
    )
    group.add_argument(
        "--straggler-steps",
        type=int,
        default=5,
        metavar="K",
        help="Consecutive slow steps before a straggler is migrated (see --straggler-factor). Default 5.",
    )
    group.add_argument(
        "--gpu-health",
        choices=("auto", "off"),
        default="auto",
        help="In-place jobs (--standby, worker API): watch the GPUs through NVML (Xid errors, ECC errors, thermal or "
        "power throttling) and migrate the ranks of an unhealthy GPU to a standby. 'auto' (default): "
        "on where NVML starts; 'off'.",
    )
    group.add_argument(
        "--shadow-steps",
        type=int,
        default=2,
        metavar="N",
        help="In-place jobs: steps a standby worker runs in its sandbox to warm up. Default 2.",
    )
    group.add_argument(
        "--handover",
        choices=("auto", "socket"),
        default="auto",
        help="Planned migrations: how the leaver's state reaches its joiner. auto (default): read straight "
        "out of the leaver's memory when both run on one host, else over the network; socket: always over "
        "the network.",
    )
    group.add_argument(
        "--console",
        choices=("auto", "live", "plain"),
        default="auto",
        help="The store host's terminal: live shows a live view of the job (ranks, standbys, events, step "
        "history, ETTR; workers' output then goes to files under --log-dir); plain prints one line per event. "
        "auto (default): live on a terminal, plain otherwise (SLURM logs, pipes).",
    )
    group.add_argument(
        "--inject-failure",
        action="append",
        default=[],
        metavar="SPEC",
        help="Failure drill (repeatable): kill a rank once, e.g. rank=1,step=8 (keys: rank, step, at=step|forward|"
        "backward|optimizer|transfer|promotion|handover|switch|recovery|subgroups, time=SECONDS, signal=KILL|TERM|RAISE, who=original|joiner); rank=R,slow=3x is a straggler, "
        "rank=R,step=N,delay=SECONDS a rank late once.",
    )
    for action in torch_parser._actions:  # noqa: SLF001
        if not action.option_strings:
            parser._add_action(action)  # noqa: SLF001
    return parser


_UNSET = object()


def explicit_dests(argv: Sequence[str]) -> set[str]:
    """Destinations of the options written on the command line (so SLURM defaults never
    override them): parse again with every default replaced by a marker."""
    probe = build_parser()
    for action in probe._actions:  # noqa: SLF001
        if action.option_strings:
            # an appending option starts from None (it cannot append to a marker)
            action.default = None if isinstance(action, argparse._AppendAction) else _UNSET  # noqa: SLF001
    parsed = vars(probe.parse_args(list(argv)))
    return {dest for dest, value in parsed.items() if value is not _UNSET and value is not None}


def _add_rdzv_conf(args: argparse.Namespace, setting: str) -> None:
    """Append ``key=value`` to --rdzv-conf."""
    args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, setting]))


def _apply_slurm(args: argparse.Namespace, given: set[str]) -> None:
    try:
        defaults = slurm_defaults(os.environ)
    except (HostlistError, ValueError) as exc:
        raise UsageError(f"cannot use the SLURM environment: {exc}") from None
    args.slurm = defaults
    if defaults is None:
        return
    total = defaults.nnodes_total
    if "nnodes" not in given:
        if args.standalone and total > 1:
            raise UsageError(
                f"--standalone runs a one-node job, but this SLURM step has {total} nodes: drop --standalone "
                "(tmrun reads the nodes from SLURM) or run the step on one node (srun -N1)"
            )
        if not defaults.in_step and total > 1:
            raise UsageError(
                f"tmrun was started outside an srun step of a {total}-node allocation, so it would train on this "
                "node only: launch it as `srun --ntasks-per-node=1 tmrun ...` (or pass --nnodes 1)"
            )
        if total == 1:
            args.nnodes = "1"  # one node: --standby N means N standby worker processes
        else:
            active = total - args.standby
            if active < 1:
                raise UsageError(
                    f"this SLURM step has {total} nodes, too few for --standby {args.standby} standby nodes plus one "
                    f"active node: run the step on at least {args.standby + 1} nodes (srun -N{args.standby + 1}), "
                    f"or on one node, where --standby {args.standby} means standby worker processes"
                )
            args.nnodes = str(active)
    if "rdzv_endpoint" not in given and "standalone" not in given and args.rdzv_backend != ETCD_BACKEND:
        # one node: the store on this host, any free port (no name to resolve); several nodes: on
        # the step's first node, at a port of this step's own
        if total == 1:
            args.rdzv_endpoint = "localhost:0"
        else:
            try:
                host = node_address(defaults.first_host, os.environ)
            except SlurmStepError as exc:
                raise UsageError(str(exc)) from None
            args.rdzv_endpoint = f"{host}:{defaults.rdzv_port}"
            if "is_host" not in args.rdzv_conf:  # only the step's first node hosts the store
                _add_rdzv_conf(args, f"is_host={int(defaults.node_rank == 0)}")
        args.ops_port = defaults.ops_port  # so that tmrun-ctl finds the job from any node of the allocation
    if "rdzv_id" not in given:
        args.rdzv_id = defaults.run_id
    if "node_rank" not in given and "node_rank=" not in args.rdzv_conf:
        # the tmrun leader's hint (group rank and node id follow SLURM_NODEID), 0 included
        _add_rdzv_conf(args, f"node_rank={defaults.node_rank}")
    if "master_addr" not in given:
        args.master_addr = defaults.first_host
    if defaults.node_name:
        os.environ.setdefault(environment.ENV_NODE_NAME, defaults.node_name)


def _apply_defaults(args: argparse.Namespace, given: set[str]) -> None:
    if "rdzv_backend" not in given:
        args.rdzv_backend = "tmrun"
    if args.standalone:
        args.rdzv_backend = "tmrun"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if args.rdzv_backend == "tmrun" and not args.rdzv_endpoint:
        single = _max_nodes(args.nnodes) == 1
        args.rdzv_endpoint = "localhost:0" if single else f"{args.master_addr}:{args.master_port}"
        if single and args.rdzv_id == "none":
            args.rdzv_id = str(uuid.uuid4())
    if args.standby and "max_restarts" not in given:
        args.max_restarts = 3  # a standby is only useful if a failure may be recovered
    if args.rdzv_backend in TMRUN_BACKENDS and args.node_rank:
        _add_rdzv_conf(args, f"node_rank={args.node_rank}")
    if args.rdzv_backend in TMRUN_BACKENDS:
        args.node_rank = 0  # a hint for the tmrun leader, in rdzv_conf; torch's node_rank is the static backend's


def _max_nodes(nnodes: str) -> int:
    from torch.distributed.run import parse_min_max_nnodes

    try:
        low, high = parse_min_max_nnodes(nnodes)
    except (ValueError, RuntimeError):
        raise UsageError(f"--nnodes {nnodes!r} is not a number or MIN:MAX") from None
    if low < 1 or high < low:
        raise UsageError(f"--nnodes {nnodes!r} needs 1 <= MIN <= MAX")
    return high


def _validate(args: argparse.Namespace) -> None:
    if args.standby < 0:
        raise UsageError(f"--standby must be 0 or more, got {args.standby}")
    if args.standby and args.rdzv_backend not in TMRUN_BACKENDS:
        raise UsageError(f"--standby needs the tmrun rendezvous backend, not {args.rdzv_backend!r}")
    _max_nodes(args.nnodes)
    nproc = str(args.nproc_per_node)
    if nproc.lstrip("-").isdigit() and int(nproc) < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, got {nproc}")
    if args.standby_wait < 0:
        raise UsageError(f"--standby-wait must be 0 or more, got {args.standby_wait}")
    if args.standby_refill_delay < 0:
        raise UsageError(f"--standby-refill-delay must be 0 or more, got {args.standby_refill_delay}")
    if not args.hang_timeout >= 0:
        raise UsageError(f"--hang-timeout must be 0 (off) or more, got {args.hang_timeout}")
    if args.straggler_factor != 0 and not args.straggler_factor > 1:
        raise UsageError(f"--straggler-factor must be above 1 (or 0: off), got {args.straggler_factor}")
    if args.straggler_steps < 1:
        raise UsageError(f"--straggler-steps must be at least 1, got {args.straggler_steps}")
    if args.shadow_steps < 0:
        raise UsageError(f"--shadow-steps must be 0 or more, got {args.shadow_steps}")
    if args.inject_failure:
        from tmrun.protocol.drills import Drill, DrillSpecError

        try:
            args.inject_failure = [Drill.parse(spec) for spec in args.inject_failure]
        except DrillSpecError as exc:
            raise UsageError(str(exc)) from None
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if args.monitor_interval <= 0:
        raise UsageError(f"--monitor-interval must be positive, got {args.monitor_interval}")
    script = args.training_script
    if args.no_python:
        if args.module:
            raise UsageError("--no-python and --module cannot be used together")
        if shutil.which(script) is None and not os.path.isfile(script):
            raise UsageError(f"program {script!r} not found")
    elif not args.module and not os.path.isfile(script):
        raise UsageError(f"training script {script!r} not found")
    _validate_device_environment()
    if args.rdzv_backend == "tmrun":
        from tmrun.rendezvous.endpoint import EndpointError, parse_endpoint

        try:
            parse_endpoint(args.rdzv_endpoint, 29400)
        except EndpointError as exc:
            raise UsageError(str(exc)) from None
    if args.rdzv_backend == ETCD_BACKEND:
        if not args.rdzv_endpoint:
            raise UsageError("--rdzv-backend tmrun-etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] "
                             "(the etcd cluster's client endpoints)")
        from tmrun.protocol.etcd import EtcdConfig, EtcdConfigError

        try:
            EtcdConfig.parse(args.rdzv_endpoint)
        except EtcdConfigError as exc:
            raise UsageError(str(exc)) from None


def _validate_device_environment() -> None:
    """``TMRUN_DEVICE_PLANE``, ``TMRUN_NCCL_LIBRARY`` (docs/nccl.md), ``TMRUN_ORPHAN_GRACE``,
    ``TMRUN_HEAL_OVERLAP`` and ``TMRUN_COMMIT_VOTE``, checked before any worker starts."""
    from tmrun.protocol import environment, orphan_guard

    try:
        environment.device_plane(os.environ)
        environment.heal_overlap(os.environ)
        environment.commit_vote(os.environ)
        orphan_guard.grace_from_environ(os.environ)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    library = os.environ.get(environment.ENV_NCCL_LIBRARY, "")
    if library and not os.path.isfile(library):
        raise UsageError(f"{environment.ENV_NCCL_LIBRARY}={library!r}: no such file "
                         "(the NCCL library to use instead of torch's)")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    given = explicit_dests(argv)
    _apply_slurm(args, given)
    _apply_defaults(args, given)
    _validate(args)
    return args


def _across_nodes(args: argparse.Namespace) -> bool:
    """Whether the job spans nodes (so --standby counts standby nodes): a SLURM step of several
    nodes, or --nnodes above 1."""
    slurm = getattr(args, "slurm", None)
    if slurm is not None and slurm.nnodes_total > 1 and "localhost:0" != args.rdzv_endpoint:
        return True
    return _max_nodes(args.nnodes) > 1


def _check_slurm_kill_settings(args: argparse.Namespace) -> None:
    """On the first node of a multi-node SLURM step: would SLURM end the job with a node?"""
    slurm = getattr(args, "slurm", None)
    if slurm is None or not slurm.in_step or slurm.node_rank != 0 or not _across_nodes(args):
        return
    from tmrun.cli.slurm_check import read_kill_settings

    for line in read_kill_settings(os.environ).warnings():
        warn(line)


def run(argv: Sequence[str]) -> int:
    args = parse(argv)
    _check_slurm_kill_settings(args)
    from torch.distributed.run import config_from_args

    from tmrun.launcher.launch import TmrunOptions, launch

    from tmrun.console.live import choose_mode

    console_mode = choose_mode(args.console)
    if console_mode == "live" and args.redirects in ("", "0"):
        args.redirects = "3"  # workers' stdout and stderr to files: the live view owns the terminal
    _one_omp_thread_per_worker(args)
    try:
        config, entrypoint, entry_args = config_from_args(args)
    except (ValueError, RuntimeError, AssertionError) as exc:
        raise UsageError(str(exc)) from None
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    from tmrun.protocol import environment

    os.environ[environment.ENV_SHADOW_STEPS] = str(args.shadow_steps)
    os.environ[environment.ENV_HANDOVER] = args.handover
    if args.inject_failure:
        os.environ[environment.ENV_INJECT_FAILURE] = ";".join(drill.encode() for drill in args.inject_failure)
    return launch(config, entrypoint, entry_args, TmrunOptions(standby=args.standby,
                                                             standby_nodes=_across_nodes(args), standby_wait=args.standby_wait,
                                                             refill_delay=args.standby_refill_delay,
                                                             console=console_mode,
                                                             log_dir=getattr(args, "log_dir", None) or None,
                                                             ops_port=getattr(args, "ops_port", 0),
                                                             hang_timeout=args.hang_timeout,
                                                             straggler_factor=args.straggler_factor,
                                                             straggler_steps=args.straggler_steps,
                                                             gpu_health=args.gpu_health == "auto"))


def _one_omp_thread_per_worker(args: argparse.Namespace) -> None:
    """torch's default for several workers on a node (``OMP_NUM_THREADS=1`` unless set), chosen
    here so that torch does not print its five-line banner about it on every start."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    from torch.distributed.run import determine_local_world_size

    try:
        several = determine_local_world_size(args.nproc_per_node) > 1
    except (ValueError, RuntimeError):
        return  # config_from_args says what is wrong with it
    if several:
        os.environ["OMP_NUM_THREADS"] = "1"


def _quiet_torch_cpp_warnings() -> None:
    """In this launcher process only, torch's C++ warnings are off (``TORCH_CPP_LOG_LEVEL``, read
    once when torch loads): a store connection that breaks would print C++ stack frames where
    tmrun prints one line saying what happened. The workers keep the user's setting."""
    if "torch" in sys.modules:
        return
    name = environment.ENV_TORCH_CPP_LOG_LEVEL
    user_value = os.environ.get(name)
    os.environ[name] = "ERROR"
    import torch  # noqa: F401 - loads c10 with the level above

    if user_value is None:
        del os.environ[name]
    else:
        os.environ[name] = user_value


NUMPY_ABSENT_WARNING = "Failed to initialize NumPy"  # torch's UserWarning, at import, where numpy is not installed


def _quiet_numpy_absent() -> None:
    """torch warns at import that it found no NumPy (which neither tmrun nor torch needs; the
    quick start's install has none), once per process: in the launcher, every worker and every
    standby. Ignored here and, through ``PYTHONWARNINGS`` (the user's filters kept, and applied
    after ours, so theirs win), in every process tmrun starts."""
    warnings.filterwarnings("ignore", message=NUMPY_ABSENT_WARNING, category=UserWarning)
    ours = f"ignore:{NUMPY_ABSENT_WARNING}:UserWarning"
    user_value = os.environ.get("PYTHONWARNINGS", "")
    if ours not in user_value.split(","):
        os.environ["PYTHONWARNINGS"] = f"{ours},{user_value}" if user_value else ours


def main(argv: Sequence[str] | None = None) -> NoReturn:
    _quiet_numpy_absent()
    _quiet_torch_cpp_warnings()  # before anything imports torch
    from tmrun.launcher.launch import LaunchError
    from tmrun.rendezvous.endpoint import EndpointError

    argv = sys.argv[1:] if argv is None else argv
    try:
        code = run(argv)
    except UsageError as exc:
        fail(str(exc))
        code = 2
    except (LaunchError, EndpointError) as exc:
        fail(str(exc))
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def entry() -> NoReturn:
    """The ``tmrun`` command: :func:`main`, then out without tearing the interpreter down. The
    launcher's work is done by then (workers and standbys stopped and waited for, the store
    closed, the totals said); Python's own teardown of torch's modules took 0.4-0.7 s on the
    2-core machine after every job (:mod:`tmrun.protocol.process_exit`). The exit handlers still
    run, and the streams are flushed."""
    from tmrun.protocol.process_exit import exit_after_handlers

    try:
        main()
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if done.code is not None and not isinstance(done.code, int):
            print(done.code, file=sys.stderr)
    exit_after_handlers(code)


if __name__ == "__main__":
    entry()

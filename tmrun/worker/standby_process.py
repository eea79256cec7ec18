"""Entry point of a standby worker process (started by tmrun.launcher.standby_pool).

It imports torch (the bulk of a cold start), says it is warm, and waits. As soon as the job's
script turns out to use the tmrun worker API (an active rank called ``tmrun.init()``), it runs
that same script in this process as a standby: the script's own ``tmrun.init()`` puts it in the
sandbox, and its ``steps()`` waits there until the controller promotes it. For a plain torchrun
script it only stands ready. It leaves on SIGTERM (exit 0) or when its agent is gone.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time

from tmrun.console import say
from tmrun.protocol import keys, orphan_guard
from tmrun.protocol.environment import LaunchEnv, Mode
from tmrun.worker.leave import exit_now


def _python_target(argv: list[str]) -> tuple[str, str] | None:
    """("path", script) or ("module", name) when argv runs the Python interpreter, else None."""
    if not argv or os.path.basename(argv[0]) != os.path.basename(sys.executable):
        return None
    rest = [a for a in argv[1:] if a != "-u"]
    if rest[:1] == ["-m"] and len(rest) > 1:
        return ("module", rest[1])
    return ("path", rest[0]) if rest else None


def _script_argv(argv: list[str]) -> list[str]:
    rest = [a for a in argv[1:] if a != "-u"]
    return rest[2:] if rest[:1] == ["-m"] else rest[1:]


def _run_script(kind: str, name: str, args: list[str]) -> None:
    sys.argv = [name] + args
    if kind == "module":
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(name, run_name="__main__")


def _run_with_rehearsal(kind: str, name: str, args: list[str]) -> None:
    """Run the script; a job with subgroups makes its first run a rehearsal
    (tmrun.worker.rehearsal): assigned (or failed) there, it runs a second time, the real one."""
    from tmrun.worker import rehearsal  # here: importing it loads torch, which main() does first

    rehearsal.allow()
    try:
        _run_script(kind, name, args)
    except rehearsal.Rehearsed:
        pass
    except BaseException as exc:  # the rehearsal's failure is answered; any other is re-raised
        if isinstance(exc, KeyboardInterrupt) or not rehearsal.failed(exc):
            raise
        say(f"standby: the script's rehearsal failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "it waits for its rank cold instead (in tmrun.init())", worker=True)
    if not rehearsal.must_run_again():
        return  # a run that was no rehearsal (a job without subgroups: the sandbox and the job in one run)
    rehearsal.tear_down()
    _run_script(kind, name, args)


def main() -> int:
    stop = False

    def _on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    env = LaunchEnv.from_environ()
    orphan_guard.start(env.agent_pid, lambda message: say(message, worker=True))
    import torch  # noqa: F401  - the warm-up: importing torch is most of a cold start
    import torch.distributed as dist

    if env.ready_file:
        with open(env.ready_file, "w") as ready:
            ready.write(str(os.getpid()))
    argv = list(env.entrypoint)
    target = _python_target(argv)
    store = None
    if target is not None and env.mode is not Mode.PLAIN:
        from tmrun.protocol.stores import open_job_store

        tcp = open_job_store(env, timeout=60)
        store = dist.PrefixStore(env.store_prefix, tcp)
    while not stop:
        if orphan_guard.orphaned(env.agent_pid):
            exit_now(0)  # orphaned: the agent died without stopping us
        if store is not None and target is not None and store.check([keys.API]):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            kind, name = target
            if kind == "path":
                sys.path.insert(0, os.path.dirname(os.path.abspath(name)))
            _run_with_rehearsal(kind, name, _script_argv(argv))
            return 0  # it ran the script (as a rank, once promoted): the interpreter's own exit
        time.sleep(0.05)
    exit_now(0)  # stopped before any script ran: nothing to tear down (torch's teardown: 0.5 s)


if __name__ == "__main__":
    sys.exit(main())

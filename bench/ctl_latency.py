"""tmrun-ctl status on a running job: the operations endpoint (new) vs the store (old way).

Starts one tmrun job on this host (--standalone, 2 workers sleeping, 1 standby worker), waits
until tmrun-ctl finds it, then times, interleaved, ``--runs`` times each, a fresh process from
its start to its exit:

* new: ``python -m tmrun.cli.ctl status --json`` (no torch: line-delimited JSON to the
  leader's operations endpoint, found through the run file);
* old: the path tmrun-ctl took before: import torch, connect a TCPStore client to the job's
  store, read the status from it (``tmrun.control.status.connect`` + ``read_status``), print JSON;
* help: ``python -m tmrun.cli.ctl --help`` (start-up alone);
* python: ``python -c pass`` (the interpreter's own start, the floor on this machine);
* and the endpoint's answer alone: one ``status`` request from this process (no start-up).

    python bench/ctl_latency.py --runs 10
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLEEPER = ROOT / "tests" / "scripts" / "sleeper.py"

OLD = """
import json, sys
from dataclasses import asdict
from tmrun.control.status import connect, read_status
from tmrun.rendezvous.endpoint import parse_endpoint
run_id, endpoint = sys.argv[1], sys.argv[2]
job = read_status(connect(parse_endpoint(endpoint, 29400), run_id), run_id, endpoint)
data = asdict(job); data["membership"]["phase"] = job.membership.phase.value
print(json.dumps(data, default=str))
"""


def _time(cmd: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{cmd[3:]} failed: {result.stderr.strip()}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    state = tempfile.mkdtemp(prefix="tmrun-ctl-bench-")
    env = {**os.environ, "TMRUN_STATE_DIR": state}
    job = subprocess.Popen([sys.executable, "-m", "tmrun.cli.main", "--standalone", "--nproc-per-node", "2",
                            "--standby", "1", str(SLEEPER), "600"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        runfile = None
        while time.monotonic() < deadline and runfile is None:
            files = list(Path(state, "runs").glob("*.json"))
            runfile = json.loads(files[0].read_text()) if files else None
            time.sleep(0.2)
        if runfile is None:
            raise SystemExit("the job did not start within 120 s")
        time.sleep(3)  # let the workers finish importing (they compete for the CPUs)
        new = [sys.executable, "-m", "tmrun.cli.ctl", "status", "--json"]
        old = [sys.executable, "-c", OLD, runfile["run_id"], runfile["endpoint"]]
        helpcmd = [sys.executable, "-m", "tmrun.cli.ctl", "--help"]
        floor = [sys.executable, "-c", "pass"]
        sys.path.insert(0, str(ROOT))
        from tmrun.protocol import ops as wire

        address = wire.parse_address(runfile["ops"])
        times: dict[str, list[float]] = {"new (endpoint)": [], "old (torch + store)": [], "help (start-up)": [],
                                         "python -c pass": [], "status request alone": []}
        for _ in range(args.runs):
            times["new (endpoint)"].append(_time(new, env))
            times["old (torch + store)"].append(_time(old, env))
            times["help (start-up)"].append(_time(helpcmd, env))
            times["python -c pass"].append(_time(floor, env))
            started = time.perf_counter()
            assert wire.ask(address, {"op": "status"})["ok"]
            times["status request alone"].append(time.perf_counter() - started)
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"tmrun-ctl status, {args.runs} runs each, seconds from process start to exit (min / median / max)")
        for name, values in times.items():
            print(f"  {name:22s} {min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}")
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the job this bench started (its own session)
        job.wait(timeout=30)


if __name__ == "__main__":
    main()

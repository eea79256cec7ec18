"""The job's store on etcd against torch's TCPStore, in one run: what each store call costs, and
how long the lead takes to move when the leading agent dies.

1. Latency of the calls tmrun makes (set, get, check, add, compare_set), one client on loopback,
   ``--ops`` of each, against a TCPStore (the default backend) and an EtcdStore (etcd 3.4+ on
   loopback, started by the bench in a temporary directory).
2. Leader takeover: a process holds the lead through its lease (``rendezvous.election.AgentLease``,
   the agents' code) and is SIGKILLed; a second one, campaigning, takes the lead. Reported: kill ->
   lead taken, for each ``--ttl``. The bound is the lease's TTL (etcd expires a lease up to about
   one TTL after its last renewal) plus the campaign interval.

    python bench/store_backends.py               # about a minute
    python bench/store_backends.py --json out.json

Needs the ``etcd`` binary (Debian: etcd-server); exits 77 without it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_etcd(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    client, peer = free_port(), free_port()
    cmd = ["etcd", "--name", "bench", "--data-dir", str(directory / "data"),
           "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
           "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
           "--initial-cluster", f"bench=http://127.0.0.1:{peer}", "--log-level", "warn"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"127.0.0.1:{client}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{endpoint}/version", timeout=1):
                return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("etcd did not start")


def latencies(store, ops: int) -> dict[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    calls = {
        "set": lambda i: store.set(f"k{i % 64}", "v" * 64),
        "get": lambda i: store.get(f"k{i % 64}"),
        "check": lambda i: store.check([f"k{i % 64}"]),
        "add": lambda i: store.add("counter", 1),
        "compare_set": lambda i: store.compare_set(f"c{i}", "", "x"),
    }
    out = {}
    for name, call in calls.items():
        samples = []
        for i in range(ops):
            start = time.perf_counter()
            call(i)
            samples.append((time.perf_counter() - start) * 1e6)
        samples.sort()
        out[name] = {"median_us": statistics.median(samples), "p90_us": samples[int(0.9 * (len(samples) - 1))]}
    return out


HOLDER = r'''
import sys, time
sys.path.insert(0, sys.argv[4])
from tmrun.protocol.etcd import EtcdConfig, EtcdStore
from tmrun.rendezvous.election import AgentLease

class Lead:
    error = None
    def stop(self): pass

store = EtcdStore.for_job(EtcdConfig.parse(sys.argv[1]), sys.argv[2])
led = []
lease = AgentLease(store, sys.argv[2], float(sys.argv[3]), lambda takeover: led.append(time.time()) or Lead(),
                   campaign_interval=0.02)
lease.start()
while not led:
    time.sleep(0.005)
print(f"LEAD {led[0]!r}", flush=True)
time.sleep(3600)
'''


def takeover(endpoint: str, ttl: float) -> float:
    """Seconds from SIGKILL of the lead's holder to the lead taken by a waiting candidate."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-c", HOLDER, endpoint, run_id, str(ttl), str(ROOT)]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True)
    assert first.stdout is not None
    first.stdout.readline()  # it leads
    second = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True)
    assert second.stdout is not None
    time.sleep(1.5 * ttl)  # the candidate campaigns, and the leader renews a few times
    killed = time.time()
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    line = second.stdout.readline().decode()
    second.kill()
    second.wait()
    return float(line.split()[1]) - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=500)
    parser.add_argument("--ttl", type=float, nargs="+", default=[1.0, 2.0, 5.0])
    parser.add_argument("--runs", type=int, default=3, help="takeovers per TTL")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if shutil.which("etcd") is None:
        print("bench/store_backends.py needs the etcd binary (Debian: etcd-server)", file=sys.stderr)
        sys.exit(77)
    import torch
    import torch.distributed as dist

    from tmrun.protocol.etcd import EtcdConfig, EtcdStore

    directory = Path(tempfile.mkdtemp(prefix="tmrun-bench-etcd-"))
    proc, endpoint = start_etcd(directory)
    try:
        master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        tcp = dist.TCPStore("127.0.0.1", master.port, is_master=False)
        report: dict[str, object] = {
            "date": dt.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "cpus": os.cpu_count(), "ops": args.ops,
            "etcd": subprocess.run(["etcd", "--version"], capture_output=True, text=True).stdout.split("\n")[0],
            "tcpstore": latencies(tcp, args.ops),
            "etcdstore": latencies(EtcdStore.for_job(EtcdConfig.parse(endpoint), "bench"), args.ops),
            "takeover_s": {str(ttl): [round(takeover(endpoint, ttl), 3) for _ in range(args.runs)] for ttl in args.ttl},
        }
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
    print(f"store call latency, one client on loopback ({args.ops} calls each): median / p90 in microseconds")
    print(f"{'call':<12} {'TCPStore':>18} {'etcd':>18}")
    for name in report["tcpstore"]:  # type: ignore[union-attr]
        t, e = report["tcpstore"][name], report["etcdstore"][name]  # type: ignore[index]
        print(f"{name:<12} {t['median_us']:>8.0f} / {t['p90_us']:<8.0f} {e['median_us']:>8.0f} / {e['p90_us']:<8.0f}")
    print("leader takeover, SIGKILL of the lead's holder -> lead taken (seconds):")
    for ttl, values in report["takeover_s"].items():  # type: ignore[union-attr]
        print(f"  lease_ttl={ttl}: {values}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

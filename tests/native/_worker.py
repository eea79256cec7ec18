"""A rank in its own process for the kill tests; speaks JSON lines (stdin commands, stdout events).

Protocol: prints {"address"}, reads {"addresses": [...]}, connects, prints {"connected"}; then
serves commands:
  {"op": "loop", "coll": name, "size": elements}  run the collective until it fails; prints
                                                  {"running"} after the first success and
                                                  {"error": cls, "peer", "t"} on failure
  {"op": "replace", "replaced": [...], "new_addresses": {...}, "new_epoch": e}  prepare + commit
  {"op": "check"}                                 allreduce rank+1 and report the sum
  {"op": "exit"}
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import tmrun_native as tn


def say(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def one(comm, coll: str, size: int, bufs: dict) -> None:
    n, r = comm.world_size, comm.rank
    if coll == "allreduce":
        comm.allreduce(bufs.setdefault("a", np.ones(size, np.float32)))
    elif coll == "broadcast":
        comm.broadcast(bufs.setdefault("a", np.ones(size, np.float32)), root=0)
    elif coll == "allgather":
        comm.allgather(bufs.setdefault("o", np.zeros(size * n, np.float32)), bufs.setdefault("i", np.ones(size, np.float32)))
    elif coll == "reduce_scatter":
        comm.reduce_scatter(bufs.setdefault("o", np.zeros(size, np.float32)), bufs.setdefault("i", np.ones(size * n, np.float32)))
    elif coll == "barrier":
        comm.barrier()
    elif coll == "sendrecv":
        s = bufs.setdefault("s", np.ones(size, np.float32))
        d = bufs.setdefault("d", np.zeros(size, np.float32))
        w = comm.send_async(s, (r + 1) % n)
        comm.recv(d, (r - 1) % n)
        w.wait()
    else:
        raise ValueError(coll)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--job", default="killtest")
    a = ap.parse_args()
    comm = tn.Communicator(a.rank, a.world, a.job, a.epoch, tn.Options(timeout=a.timeout))
    say(address=comm.address)
    msg = json.loads(sys.stdin.readline())
    comm.connect(msg["addresses"])
    say(connected=True, links=comm.links())
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "loop":
            bufs: dict = {}
            i = 0
            try:
                while True:
                    one(comm, cmd["coll"], cmd["size"], bufs)
                    i += 1
                    if i == 1:
                        say(running=True)
            except tn.PeerLostError as e:
                say(error="PeerLostError", peer=e.peer, epoch=e.epoch, reporter=e.reporter, t=time.time(), msg=str(e))
            except Exception as e:  # noqa: BLE001
                say(error=type(e).__name__, peer=getattr(e, "peer", None), t=time.time(), msg=str(e))
        elif op == "replace":
            t0 = time.time()
            comm.prepare(cmd["replaced"], {int(k): v for k, v in cmd["new_addresses"].items()}, cmd["new_epoch"])
            comm.commit()
            say(committed=True, seconds=time.time() - t0, counters=comm.counters(), links=comm.links())
        elif op == "check":
            x = np.full(1000, comm.rank + 1, np.float64)
            comm.allreduce(x)
            say(check=float(x[0]), epoch=comm.epoch)
        elif op == "exit":
            break
    comm.close()
    say(exited=True)


if __name__ == "__main__":
    main()

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
import array
import json
import sys
import time

import tmrun_native as tn

# Buffers are stdlib arrays (typed buffers: the communicator infers float32/float64 from their
# format), so this process needs no third-party package and starts quickly (no torch import).


def ones(size: int, code: str = "f") -> array.array:
    return array.array(code, [1.0]) * size


def zeros(size: int, code: str = "f") -> array.array:
    return array.array(code, bytes(array.array(code).itemsize * size))


def say(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def one(comm, coll: str, size: int, bufs: dict) -> None:
    n, r = comm.world_size, comm.rank
    if coll == "allreduce":
        comm.allreduce(bufs.setdefault("a", ones(size)))
    elif coll == "broadcast":
        comm.broadcast(bufs.setdefault("a", ones(size)), root=0)
    elif coll == "allgather":
        comm.allgather(bufs.setdefault("o", zeros(size * n)), bufs.setdefault("i", ones(size)))
    elif coll == "reduce_scatter":
        comm.reduce_scatter(bufs.setdefault("o", zeros(size)), bufs.setdefault("i", ones(size * n)))
    elif coll == "barrier":
        comm.barrier()
    elif coll == "sendrecv":
        s = bufs.setdefault("s", ones(size))
        d = bufs.setdefault("d", zeros(size))
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
            x = array.array("d", [comm.rank + 1.0]) * 1000
            comm.allreduce(x)
            say(check=float(x[0]), epoch=comm.epoch)
        elif op == "exit":
            break
    comm.close()
    say(exited=True)


if __name__ == "__main__":
    main()

"""The store requests a change's waits make, for the whole job, by job size: tmrun's waits as they
are (tmrun.worker.store_pace) against the same waits unbounded (every look at the small job's
pace, as before 2026-12-07), in one run.

Counted, not timed: each wait runs against a store that counts its requests, with a sleep that only
adds up what it is asked to wait (virtual time), for ``--looks`` looks; the job's rate is one
worker's requests per second of that time times the world size (every survivor waits at once).
The address wait is counted over its first 99 looks (the fast ones: a change's downtime).

    python bench/store_pace.py                      # a second
    python bench/store_pace.py --worlds 8,1000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tmrun.control.replacement.core import write_gen_file  # noqa: E402
from tmrun.protocol import keys  # noqa: E402
from tmrun.protocol.environment import LaunchEnv  # noqa: E402
from tmrun.worker import context, store_pace, vote  # noqa: E402


class CountingStore:
    """Counts the calls; nothing a wait waits for ever comes."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {keys.GEN: b"1"}
        self.requests = 0

    def check(self, names: list[str]) -> bool:
        self.requests += 1
        return all(name in self.data for name in names)

    def get(self, name: str) -> bytes:
        self.requests += 1
        return self.data[name]

    def set(self, name: str, value: str) -> None:
        self.requests += 1
        self.data[name] = value.encode()

    def add(self, name: str, amount: int) -> int:
        self.requests += 1
        value = int(self.data.get(name, b"0")) + amount
        self.data[name] = str(value).encode()
        return value


class _Enough(Exception):
    pass


def job_rate(wait: Callable[[CountingStore], object], world_size: int, looks: int) -> float:
    """The whole job's store requests per second, were every worker waiting like this one."""
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) >= looks:
            raise _Enough

    store = CountingStore()
    virtual = _VirtualTime(sleep)
    context.time, vote.time = virtual, virtual  # type: ignore[assignment]  (those modules only: no other thread)
    try:
        wait(store)
    except _Enough:
        pass
    finally:
        context.time, vote.time = time, time
    return store.requests / sum(slept) * world_size


class _VirtualTime:
    """The ``time`` module as a wait sees it, with its own ``sleep``."""

    def __init__(self, sleep: Callable[[float], None]) -> None:
        self.sleep = sleep

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def waits(world_size: int, work: Path) -> dict[str, tuple[Callable[[CountingStore], object], int]]:
    """name -> (the wait, the looks to count it over)."""
    gen_file = work / f"gen-{world_size}"
    write_gen_file(str(gen_file), 1)
    with_file = context.Context(LaunchEnv(gen_file=str(gen_file), recovery_timeout=120.0, world_size=world_size))
    without = context.Context(LaunchEnv(gen_file="", recovery_timeout=120.0, world_size=world_size))

    def address(store: CountingStore) -> object:
        with_file.store = store  # type: ignore[assignment]
        return with_file.address_getter(1)(store, "never")

    def plan(ctx: context.Context) -> Callable[[CountingStore], object]:
        def wait(store: CountingStore) -> object:
            ctx.store = store  # type: ignore[assignment]
            return ctx.await_key(keys.plan(2), float("inf"), poll=context.FAST_POLL)
        return wait

    return {
        "joiner's address": (address, 99),
        "plan (generation file)": (plan(with_file), 400),
        "plan (store only)": (plan(without), 400),
        "lost vote's records": (
            lambda store: vote.others_committed(store, 1, 0, world_size, 5, lambda: 1, float("inf")),  # type: ignore[arg-type]
            400),
    }


def measure(worlds: list[int]) -> list[dict[str, object]]:
    rows = []
    budget = store_pace.STORE_BUDGET
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            for name in waits(world, Path(tmp)):
                row: dict[str, object] = {"world": world, "wait": name}
                for label, limit in (("unbounded", float("inf")), ("tmrun", budget)):
                    store_pace.STORE_BUDGET = limit
                    try:
                        wait, looks = waits(world, Path(tmp))[name]
                        row[label] = job_rate(wait, world, looks)
                    finally:
                        store_pace.STORE_BUDGET = budget
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="8,64,1000,4096", help="job sizes (ranks), comma-separated")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
        if any(w < 1 for w in worlds):
            raise ValueError
    except ValueError:
        parser.error(f"--worlds: positive integers, comma-separated (got {args.worlds!r})")
    rows = measure(worlds)
    print(f"store requests per second of the whole job (budget {store_pace.STORE_BUDGET:,.0f})")
    print(f"{'ranks':>6} | {'wait':<24} | {'unbounded':>11} | {'tmrun':>9}")
    for row in rows:
        print(f"{row['world']:>6} | {row['wait']:<24} | {row['unbounded']:>11,.0f} | {row['tmrun']:>9,.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How often a waiting worker may ask the in-place store, so that a large job's waits do not
swamp the one store every worker shares.

During a change every survivor waits at once: for the plan, for the joiners' addresses (every
survivor reads every joiner's), for the commit records of a vote that lost a peer. Each wait
polls (torch's ``TCPStore.wait`` logs two C++ warnings per timed-out wait, and a wait left
running cannot be given up when the generation moves). At the 2 ms that keeps a small job's
downtime short, 1,000 ranks would ask one TCPStore server about 500,000 times a second; one
server answered about 96,000 ``check`` requests a second from four clients on this project's
2-core machine. So the pace of a look is set by the job's size: a small job looks every 2 ms as
before, a large one as often as keeps the whole job's waiting workers under STORE_BUDGET
requests a second together (at 1,000 ranks: a look every 20 ms for one request per look).
"""

from __future__ import annotations

import math

STORE_BUDGET = 50_000.0  # requests per second that every waiting worker of a job makes together, at most


def interval(world_size: int, floor: float, requests_per_look: float = 1.0) -> float:
    """Seconds between two looks of one waiting worker: ``floor`` (the small job's pace), or
    longer where ``world_size`` workers making ``requests_per_look`` store requests a look each
    would together exceed STORE_BUDGET."""
    return max(floor, max(world_size, 1) * requests_per_look / STORE_BUDGET)


def looks_per_store_ask(world_size: int, look: float, every: int, requests_per_ask: float = 1.0) -> int:
    """A wait that looks at a local file every ``look`` seconds and asks the store every
    ``every``-th look (``requests_per_ask`` requests): how many looks apart its store asks must be
    for the job's waiting workers to stay under STORE_BUDGET together (``every`` at least)."""
    apart = interval(world_size, look * every, requests_per_ask)
    return max(every, math.ceil(apart / look - 1e-9))  # up, never under the budget's spacing (1e-9: float noise)

"""Failure drills as the launcher passes them to workers: ``rank=1,step=8[,at=backward]``.

The spec (:class:`Drill`: parsing with one-line errors, encoding) is part of the contract
between the CLI and the workers (``TMRUN_INJECT_FAILURE``, drills joined by ``;``); firing them
is the worker's (:mod:`tmrun.worker.drills`, which documents the points and options).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from tmrun.protocol import environment

ENV = environment.ENV_INJECT_FAILURE
POINTS = ("step", "forward", "backward", "optimizer", "transfer", "promotion", "handover", "switch", "recovery",
          "subgroups")
ANY_STEP = ("promotion", "handover", "switch", "recovery", "subgroups")  # points that happen once, whatever the step
STEP_OPTIONAL = (*ANY_STEP, "transfer")  # without step=, a transfer drill fires at the first donation


class DrillSpecError(ValueError):
    """The --inject-failure spec is malformed (one line for the user)."""


@dataclass(frozen=True)
class Drill:
    rank: int  # -1 for a node drill
    step: int = -1
    at: str = "step"
    seconds: float = -1.0
    signal_name: str = "KILL"
    who: str = "original"
    node: int = -1  # group rank of a node to kill whole (agent and workers)
    slow: float = 0.0  # > 1: from ``step`` on (0 by default) each step takes about this many times longer
    delay: float = 0.0  # > 0: the rank sleeps this many seconds at the point, once (late, not failed)

    @classmethod
    def parse(cls, text: str) -> Drill:
        fields: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or not key or not value:
                raise DrillSpecError(f"--inject-failure: {part.strip()!r} is not key=value (e.g. rank=1,step=8)")
            if key in fields:
                raise DrillSpecError(f"--inject-failure: {key} given twice")
            fields[key] = value.strip()
        unknown = set(fields) - {"rank", "node", "step", "at", "time", "signal", "who", "slow", "delay"}
        if unknown:
            raise DrillSpecError(f"--inject-failure: unknown key {sorted(unknown)[0]!r} "
                                 "(keys: rank, node, step, at, time, signal, who, slow, delay)")
        if ("rank" in fields) == ("node" in fields):
            raise DrillSpecError("--inject-failure needs rank=N or node=G (one of them)")
        try:
            node = int(fields.get("node", "-1"))
            rank = int(fields.get("rank", "-1" if "node" in fields else "0"))
            step = int(fields.get("step", "-1"))
            seconds = float(fields.get("time", "-1"))
        except ValueError:
            raise DrillSpecError("--inject-failure: rank, node and step must be integers, time a number") from None
        if not abs(seconds) < float("inf"):  # nan never fired; inf crashed the worker's timer thread
            raise DrillSpecError(f"--inject-failure: time={fields['time']!r} must be a finite number of seconds")
        if "slow" in fields:
            return cls._parse_slow(fields, rank, step)
        delay = cls._parse_delay(fields) if "delay" in fields else 0.0
        at = fields.get("at", "promotion" if fields.get("who") == "joiner" else "step")
        if at not in POINTS:
            raise DrillSpecError(f"--inject-failure: at={at!r} is not one of {', '.join(POINTS)}")
        who = fields.get("who", "original")
        if who not in ("original", "joiner"):
            raise DrillSpecError("--inject-failure: who must be original or joiner")
        name = fields.get("signal", "KILL").upper().removeprefix("SIG")
        if name not in ("RAISE", "STALL") and not hasattr(signal, f"SIG{name}"):
            raise DrillSpecError(f"--inject-failure: unknown signal {fields.get('signal')!r}")
        if "node" in fields and node < 0:
            raise DrillSpecError("--inject-failure: node must be >= 0")
        if "node" in fields and (who == "joiner" or name in ("RAISE", "STALL")):
            raise DrillSpecError("--inject-failure: node=G kills a node's processes "
                                 "(no who=joiner, no signal=RAISE or STALL)")
        if "rank" in fields and rank < 0:
            raise DrillSpecError("--inject-failure: rank must be >= 0")
        if name == "RAISE" and seconds >= 0:
            raise DrillSpecError("--inject-failure: signal=RAISE needs step=N (an exception cannot be raised from a timer)")
        if name == "STALL" and seconds >= 0:
            raise DrillSpecError("--inject-failure: signal=STALL needs step=N (a timer cannot stall the training loop)")
        if who == "original" and step < 0 and seconds < 0 and at not in STEP_OPTIONAL:
            raise DrillSpecError("--inject-failure needs step=N or time=SECONDS")
        if delay:
            name = "DELAY"
        return cls(rank=rank, step=step, at=at, seconds=seconds, signal_name=name, who=who, node=node, delay=delay)

    @staticmethod
    def _parse_delay(fields: dict[str, str]) -> float:
        """``rank=R,step=N[,at=P],delay=S``: rank R sleeps S seconds at that point, once."""
        extra = set(fields) & {"signal", "node", "time"}
        if extra or "rank" not in fields:
            raise DrillSpecError("--inject-failure: delay=S takes rank=R, step=N and optionally at=P and who= "
                                 f"(not {', '.join(sorted(extra)) or 'node'})")
        try:
            delay = float(fields["delay"].lower().removesuffix("s"))
        except ValueError:
            raise DrillSpecError(f"--inject-failure: delay={fields['delay']!r} is not a number of seconds") from None
        if not 0 < delay <= 600:
            raise DrillSpecError(f"--inject-failure: delay={fields['delay']!r} must be above 0 and at most 600 seconds")
        return delay

    @classmethod
    def _parse_slow(cls, fields: dict[str, str], rank: int, step: int) -> Drill:
        """``rank=R,slow=3x[,step=N]``: a straggler, not a failure."""
        extra = set(fields) - {"rank", "slow", "step"}
        if extra or "rank" not in fields:
            raise DrillSpecError("--inject-failure: slow=F takes rank=R and optionally step=N "
                                 f"(not {', '.join(sorted(extra)) or 'node'})")
        if rank < 0:
            raise DrillSpecError("--inject-failure: rank must be >= 0")
        try:
            factor = float(fields["slow"].lower().removesuffix("x"))
        except ValueError:
            raise DrillSpecError(f"--inject-failure: slow={fields['slow']!r} is not a factor such as 3x") from None
        if not factor > 1 or factor != factor or factor > 1000:
            raise DrillSpecError(f"--inject-failure: slow={fields['slow']!r} must be a factor above 1 (e.g. 3x)")
        return cls(rank=rank, step=max(step, 0), slow=factor, signal_name="NONE")

    def encode(self) -> str:
        if self.slow:
            return f"rank={self.rank},slow={self.slow}x,step={self.step}"
        target = f"node={self.node}" if self.node >= 0 else f"rank={self.rank}"
        action = f"delay={self.delay}" if self.delay else f"signal={self.signal_name}"
        parts = [target, f"at={self.at}", action, f"who={self.who}"]
        if self.step >= 0:
            parts.append(f"step={self.step}")
        if self.seconds >= 0:
            parts.append(f"time={self.seconds}")
        return ",".join(parts)


def parse_all(text: str) -> list[Drill]:
    """Drills joined by ';' (how the launcher passes several to the workers)."""
    return [Drill.parse(part) for part in text.split(";") if part.strip()]

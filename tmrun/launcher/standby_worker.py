"""Entry point of a single-node standby process: warm up, say ready, wait to be needed.

It leaves on SIGTERM (exit 0) or when the agent that started it is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def main() -> int:
    stop = False

    def _on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    agent_pid = int(os.environ.get("TMRUN_AGENT_PID", "0"))
    import torch  # noqa: F401  - the warm-up: importing torch is most of a cold start
    import torch.distributed  # noqa: F401

    ready_file = os.environ.get("TMRUN_STANDBY_READY_FILE")
    if ready_file:
        with open(ready_file, "w") as ready:
            ready.write(str(os.getpid()))
    while not stop:
        if agent_pid and os.getppid() != agent_pid:
            return 0  # orphaned: the agent died without stopping us
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

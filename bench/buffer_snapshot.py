"""What tmrun's step-start copy of the tracked modules' persistent buffers costs per step
(tmrun/worker/buffers.py: batch norm's statistics, put back when a failure aborts the step),
against the same module's forward in the same run (the baseline: a step does at least that).

    OMP_NUM_THREADS=1 python bench/buffer_snapshot.py
"""

from __future__ import annotations

import time

import torch

from tmrun.worker.buffers import BufferSnapshot, persistent_buffers


def per_call_us(fn, n: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    channels = [64] * 3 + [256] * 10 + [128] * 12 + [512] * 12 + [256] * 16  # 53 batch norms, as ResNet-50
    norms = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Conv2d(c, c, 1), torch.nn.BatchNorm2d(c)) for c in channels)
    inputs = [torch.randn(8, c, 8, 8) for c in channels]
    blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64),
                                                       torch.nn.Linear(64, 64)) for _ in range(96)])
    tokens = torch.randn(8, 64)
    cases = [("53 conv + batch norm blocks (ResNet-50's batch norms)", norms,
              lambda: [block(x) for block, x in zip(norms, inputs)], 5),
             ("96 linear/layernorm blocks, no persistent buffer (LLM-like)", blocks, lambda: blocks(tokens), 50)]
    for name, module, forward, repeats in cases:
        snapshot = BufferSnapshot()
        copy = per_call_us(lambda: snapshot.take(persistent_buffers(module)), 500)
        with torch.no_grad():
            baseline = per_call_us(forward, repeats)
        print(f"{name}: buffer copy {copy:.0f} us per step ({snapshot.nbytes / 1e6:.2f} MB), "
              f"forward of a batch of 8 {baseline:.0f} us: {100 * copy / baseline:.1f}% of it")


if __name__ == "__main__":
    main()

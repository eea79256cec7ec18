"""tmrun.worker.compiled_code: a standby that takes a rank drops what dynamo compiled before,
because dynamo folds the rank into its graphs with no guard (torch's premise, checked here on a
fake two-rank world: the rank changes under a compiled function, as a standby's does)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tmrun.worker import compiled_code


@pytest.fixture
def as_rank() -> Iterator[Callable[[int], None]]:
    """(Re)initialise a fake two-rank world as the given rank (no peer is needed)."""

    def init(rank: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)

    try:
        yield init
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.compiler.reset()


def test_a_rank_read_in_compiled_code_is_dropped_with_the_graph(as_rank: Callable[[int], None]) -> None:
    torch.compiler.reset()
    plus_rank = torch.compile(lambda x: x + dist.get_rank(), backend="eager", fullgraph=True)
    as_rank(0)  # the standby's sandbox: rank 0
    assert plus_rank(torch.zeros(())).item() == 0
    as_rank(1)  # assigned rank 1
    assert plus_rank(torch.zeros(())).item() == 0, "dynamo no longer folds the rank: this module may not be needed"
    said: list[str] = []
    assert compiled_code.forget_for_new_rank(1, said.append)
    assert plus_rank(torch.zeros(())).item() == 1
    assert len(said) == 1 and said[0].startswith("rank 1: ") and "compile again for this rank" in said[0]


def test_nothing_is_said_or_imported_when_nothing_was_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch._dynamo.utils", raising=False)
    said: list[str] = []
    assert compiled_code.traced_graphs() == 0
    assert not compiled_code.forget_for_new_rank(1, said.append)
    assert said == [] and "torch._dynamo.utils" not in sys.modules

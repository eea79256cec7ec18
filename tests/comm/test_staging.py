"""Host staging (tmrun.comm.staging), the one CUDA path of the backend and of the worker's state
transfers, exercised on CPU: what is usable in place is, the rest goes through host copies."""

from __future__ import annotations

import pytest
import torch

from tmrun.comm import backend as tb
from tmrun.comm import staging


def test_staging_helpers_on_cpu() -> None:
    t = torch.arange(6.0)
    assert staging.to_host(t) is t
    nc = torch.arange(12.0).reshape(3, 4)[:, ::2]
    h = staging.to_host(nc)
    assert h.is_contiguous() and torch.equal(h, nc)
    h.fill_(1.0)
    staging.from_host(nc, h)
    assert torch.equal(nc, torch.ones(3, 2))
    assert not staging.to_host(nc, copy=False).data_ptr() == nc.data_ptr()
    with pytest.raises(tb.UnsupportedError, match="meta"):
        staging.to_host(torch.ones(2, device="meta"))
    assert tb.UnsupportedError is staging.UnsupportedError  # the backend's error type


def test_byte_view_shares_memory() -> None:
    t = torch.arange(4, dtype=torch.int32)
    view = staging.byte_view(t)
    assert view.dtype == torch.uint8 and view.numel() == 16
    view[:4] = 255
    assert t[0].item() == -1


def test_host_bytes_in_place_and_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, empty = torch.arange(5.0), torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.empty(0)
    direct = staging.HostBytes([a, empty, b], load=True)
    assert [v.data_ptr() for v in direct.views] == [a.data_ptr(), b.data_ptr()]  # no copies, empty left out
    # tensors that cannot be used in place (CUDA ones): host copies, loaded or stored back
    monkeypatch.setattr(staging, "is_host_ready", lambda tensor: False)
    sent = staging.HostBytes([a, b], load=True)
    assert all(v.data_ptr() not in (a.data_ptr(), b.data_ptr()) for v in sent.views)
    received_a, received_b = torch.zeros(5), torch.zeros(2, 3, dtype=torch.int64)
    receiving = staging.HostBytes([received_a, received_b], load=False)
    for src, dst in zip(sent.views, receiving.views):
        dst.copy_(src)
    assert not received_a.any()  # nothing reaches the tensors before store()
    receiving.store()
    assert torch.equal(received_a, a) and torch.equal(received_b, b)


def test_non_contiguous_tensors_are_stored_back() -> None:
    base = torch.zeros(4, 4)
    column = base[:, 1]
    receiving = staging.HostBytes([column], load=False)
    receiving.views[0].copy_(staging.byte_view(torch.arange(4.0)))
    receiving.store()
    assert torch.equal(base[:, 1], torch.arange(4.0)) and not base[:, 0].any()

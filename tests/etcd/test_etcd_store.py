"""EtcdStore against a real etcd: TCPStore's semantics (the same calls on both, the same
answers), through torch's PrefixStore, bounded waits, leases, endpoint failover, bad input."""

from __future__ import annotations

import datetime
import time
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import free_port
from tmrun.protocol.etcd import EtcdConfig, EtcdConfigError, EtcdError, EtcdStore, EtcdUnavailableError


def _store(server, timeout: float = 2.0, **kw) -> EtcdStore:  # type: ignore[no-untyped-def]
    return EtcdStore.for_job(EtcdConfig.parse(server.endpoint), f"t-{uuid.uuid4().hex[:8]}", timeout=timeout, **kw)


def _tcp() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=2))


def _script(store: dist.Store) -> list[object]:
    """The calls tmrun makes on its stores, with their answers."""
    out: list[object] = []
    store.set("a", "1")
    out.append(store.get("a"))
    out += [store.add("n", 1), store.add("n", 5), store.add("n", 0), store.add("fresh", 0)]
    out += [store.compare_set("c", "", "x"), store.compare_set("c", "y", "z"), store.compare_set("c", "x", "w"),
            store.get("c"), store.compare_set("missing", "e", "d")]
    out += [store.check(["a", "c"]), store.check(["a", "nope"])]
    store.set("bin", bytes(range(256)))
    out.append(store.get("bin"))
    out += [store.delete_key("a"), store.delete_key("a"), store.check(["a"])]
    store.wait(["c"])
    return out


def test_same_answers_as_tcpstore(etcd_server) -> None:  # type: ignore[no-untyped-def]
    tcp = _tcp()
    assert _script(_store(etcd_server)) == _script(tcp)
    assert _script(dist.PrefixStore("p", _store(etcd_server))) == _script(dist.PrefixStore("p", _tcp()))


@pytest.mark.e2e  # over half a second: waits out a timeout (the unit subset stays within a minute)
def test_get_and_wait_are_bounded(etcd_server) -> None:  # type: ignore[no-untyped-def]
    store = _store(etcd_server, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="not set within"):
        store.get("never")
    with pytest.raises(dist.DistStoreError, match="Wait timeout"):
        dist.PrefixStore("x", store).wait(["never"], datetime.timedelta(seconds=0.3))
    assert time.monotonic() - started < 5


def test_add_is_atomic_across_clones(etcd_server) -> None:  # type: ignore[no-untyped-def]
    import threading

    store = _store(etcd_server)
    clones = [store.clone() for _ in range(4)]
    threads = [threading.Thread(target=lambda s=s: [s.add("counter", 1) for _ in range(25)]) for s in clones]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert store.add("counter", 0) == 100


def test_namespaces_are_separate_and_counted(etcd_server) -> None:  # type: ignore[no-untyped-def]
    one, two = _store(etcd_server), _store(etcd_server)
    one.set("k", "1")
    assert not two.check(["k"])
    two.set("k", "2")
    two.set("l", "3")
    assert (one.get("k"), two.get("k")) == (b"1", b"2")
    assert (one.num_keys(), two.num_keys()) == (1, 2)
    assert two.list_prefix("") == {"k": b"2", "l": b"3"}


def test_a_key_on_a_lease_goes_with_it(etcd_server) -> None:  # type: ignore[no-untyped-def]
    store = _store(etcd_server)
    lease = store.grant_lease(1)
    assert store.create("lead", "me", lease)
    assert not store.create("lead", "you")  # only the first creator wins
    store.put("alive/3", "x", lease=lease)
    assert store.keep_alive(lease) > 0
    store.revoke_lease(lease)
    assert store.list_prefix("") == {}
    assert store.keep_alive(lease) <= 0  # gone: nobody can renew it


def test_an_unreachable_first_endpoint_is_skipped(etcd_server) -> None:  # type: ignore[no-untyped-def]
    config = EtcdConfig.parse(f"127.0.0.1:{free_port()},{etcd_server.endpoint}")
    store = EtcdStore(config, f"/t/{uuid.uuid4().hex}/", connect_timeout=5)
    store.set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.e2e  # over half a second: waits out a timeout (the unit subset stays within a minute)
def test_no_endpoint_answers_one_bounded_error() -> None:
    store_config = EtcdConfig.parse(f"127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match="etcd unreachable") as caught:
        EtcdStore(store_config, "/t/x/", connect_timeout=1).set("k", "v")
    assert isinstance(caught.value, dist.DistError)  # the agent's "lost the job's store" path
    assert "\n" not in str(caught.value)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("text, message", [
    ("", "empty"), ("host:port", "malformed"), ("h:0", "malformed"), ("h:99999", "malformed"), (",", "empty"),
])
def test_bad_endpoints_are_one_line(text: str, message: str) -> None:
    with pytest.raises(EtcdConfigError, match=message):
        EtcdConfig.parse(text)


def test_endpoint_forms() -> None:
    config = EtcdConfig.parse("etcd://a:1, http://b:2,https://[::1]:3,c")
    assert config.endpoints == (("a", 1), ("b", 2), ("::1", 3), ("c", 2379))
    assert EtcdConfig.parse(config.url()) == config
    with pytest.raises(EtcdConfigError, match="go together"):
        EtcdConfig.parse("a:1", {"etcd_cert": "x"})
    with pytest.raises(EtcdConfigError, match="password_file"):
        EtcdConfig.parse("a:1", {"etcd_user": "root"})


def test_a_counter_that_is_not_one_is_an_error(etcd_server) -> None:  # type: ignore[no-untyped-def]
    store = _store(etcd_server)
    store.set("k", "not a number")
    with pytest.raises(EtcdError, match="not a counter"):
        store.add("k", 1)


def test_something_else_than_etcd_is_an_error(tmp_path: Path) -> None:
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)  # a prompt shutdown()
    thread.start()
    try:
        store = EtcdStore(EtcdConfig.parse(f"127.0.0.1:{server.server_address[1]}"), "/t/", connect_timeout=2)
        with pytest.raises(EtcdError, match="etcd /v3/kv/put|not JSON"):
            store.set("k", "v")
    finally:
        server.shutdown()
        server.server_close()

"""The job's store on etcd v3: a ``torch.distributed.Store`` that survives the loss of any node.

Talks to etcd's JSON gateway (``/v3/kv/*``, ``/v3/lease/*``; etcd 3.4 and later) over HTTP or
HTTPS with the standard library only: every process of a job (agents, workers, standby workers)
opens one. Every key lives under the job's namespace ``/tmrun/<run id>/`` so that jobs share an
etcd cluster safely. Semantics follow torch's ``TCPStore``: ``get`` and ``wait`` block until the
keys exist (bounded by the store's timeout), ``add`` keeps a decimal counter, ``compare_set``
returns the value now stored.

Endpoints: ``host:port[,host:port...]`` (etcd's client URLs); a request that cannot reach one
endpoint tries the next, until the store's connect timeout has passed; then it raises
:class:`EtcdUnavailableError` (a ``torch.distributed.DistStoreError``: the agent reports a lost
store in one line). TLS and etcd's own authentication come from :class:`EtcdConfig` (rdzv-conf
``etcd_cacert``, ``etcd_cert``, ``etcd_key``, ``etcd_user``, ``etcd_password_file``).

Besides the Store interface, leases for leadership and liveness: :meth:`EtcdStore.grant_lease`,
:meth:`~EtcdStore.keep_alive`, :meth:`~EtcdStore.revoke_lease`, :meth:`~EtcdStore.create` (a key
written only if absent, optionally bound to a lease) and :meth:`~EtcdStore.list_prefix`.
"""

from __future__ import annotations

import base64
import datetime
import http.client
import ipaddress
import json
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence
from urllib.parse import quote

import torch.distributed as dist

DEFAULT_PORT = 2379
SCHEME = "etcd://"
NAMESPACE_ROOT = "/tmrun/"
_POLL = 0.005  # seconds between checks of a key that get() or wait() waits for (doubling to _POLL_MAX)
_POLL_MAX = 0.02
# torch reaches a Python store's methods through the Python object: once that object is gone, a
# PrefixStore that wraps it fails with "Not implemented". A process opens a handful of these
# stores, so each is kept for the life of the process.
_KEEP_ALIVE: list["EtcdStore"] = []
_KEEP_LOCK = threading.Lock()


class EtcdError(dist.DistStoreError):
    """etcd answered with an error (or something that is not its JSON gateway)."""


class EtcdUnavailableError(EtcdError):
    """No endpoint of the etcd cluster answered within the connect timeout."""


class EtcdConfigError(ValueError):
    """A malformed etcd endpoint list or option (one line for the user)."""


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach the etcd cluster. Everything but the endpoints is optional."""

    endpoints: tuple[tuple[str, int], ...]
    cacert: str = ""  # TLS: the CA bundle that signed the servers' certificates (https when set)
    cert: str = ""  # TLS client certificate and key (etcd's --client-cert-auth)
    key: str = ""
    user: str = ""  # etcd authentication (etcd's `auth enable`); the password comes from a file
    password_file: str = ""

    @classmethod
    def parse(cls, endpoints: str, options: Optional[dict[str, str]] = None) -> EtcdConfig:
        opts = {k: str(v) for k, v in (options or {}).items()}
        hosts: list[tuple[str, int]] = []
        text = endpoints.strip()
        if text.startswith(SCHEME):
            text = text[len(SCHEME):]
        for item in filter(None, (part.strip() for part in text.split(","))):
            for scheme in ("http://", "https://"):
                if item.startswith(scheme):
                    item = item[len(scheme):]
            if item.startswith("[") and "]:" in item:  # [v6]:port
                host, _, port_text = item[1:].partition("]:")
            elif item.count(":") == 1:
                host, _, port_text = item.partition(":")
            else:  # a name, a v4 address, or a bare v6 address: the default port
                host, port_text = item.strip("[]"), str(DEFAULT_PORT)
                if ":" in host and not _is_ipv6(host):
                    raise EtcdConfigError(f"malformed etcd endpoint {item!r}: write host:port (an IPv6 host as [addr]:port)")
            if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise EtcdConfigError(f"malformed etcd endpoint {item!r}: write host:port")
            hosts.append((host, int(port_text)))
        if not hosts:
            raise EtcdConfigError("the etcd endpoint list is empty")
        config = cls(tuple(hosts), cacert=opts.get("etcd_cacert", ""), cert=opts.get("etcd_cert", ""),
                     key=opts.get("etcd_key", ""), user=opts.get("etcd_user", ""),
                     password_file=opts.get("etcd_password_file", ""))
        if bool(config.cert) != bool(config.key):
            raise EtcdConfigError("etcd_cert and etcd_key go together")
        if bool(config.user) != bool(config.password_file):
            raise EtcdConfigError("etcd_user needs etcd_password_file (a password is never an option's value)")
        return config

    @property
    def tls(self) -> bool:
        return bool(self.cacert or self.cert)

    def url(self) -> str:
        """The endpoints as one string (``etcd://h:p,h:p``): the workers' ``TMRUN_IP_STORE``."""
        return SCHEME + ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)

    def options(self) -> dict[str, str]:
        """The non-endpoint options (file paths only: no secret travels in them)."""
        return {k: v for k, v in (("etcd_cacert", self.cacert), ("etcd_cert", self.cert), ("etcd_key", self.key),
                                  ("etcd_user", self.user), ("etcd_password_file", self.password_file)) if v}


def _is_ipv6(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else bytes(text)
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    ending = bytearray(prefix)
    while ending:
        if ending[-1] < 0xFF:
            ending[-1] += 1
            return bytes(ending)
        ending.pop()
    return b"\0"


class _Client:
    """One HTTP(S) keep-alive connection per thread to the first endpoint that answers."""

    def __init__(self, config: EtcdConfig, connect_timeout: float) -> None:
        self.config = config
        self.connect_timeout = connect_timeout
        self._local = threading.local()
        self._preferred = 0
        self._token = ""
        self._token_lock = threading.Lock()
        self._ssl: Optional[ssl.SSLContext] = None
        if config.tls:
            context = ssl.create_default_context(cafile=config.cacert or None)
            if config.cert:
                context.load_cert_chain(config.cert, config.key)
            self._ssl = context

    def _connect(self, index: int, timeout: float) -> http.client.HTTPConnection:
        host, port = self.config.endpoints[index]
        if self._ssl is not None:
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=self._ssl)
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def call(self, path: str, body: dict[str, Any], read_timeout: float = 10.0,
             retried: bool = False) -> dict[str, Any]:
        """POST ``body`` to ``path`` of the first endpoint that answers; the decoded reply."""
        data = json.dumps(body).encode()
        deadline = time.monotonic() + self.connect_timeout
        endpoints = len(self.config.endpoints)
        attempt = 0
        last: BaseException | None = None
        while True:
            index = (self._preferred + attempt) % endpoints
            conn = getattr(self._local, "conn", None)
            if conn is None or getattr(self._local, "index", -1) != index:
                if conn is not None:
                    conn.close()
                conn = self._local.conn = self._connect(index, read_timeout)
                self._local.index = index
            try:
                headers = {"Content-Type": "application/json"}
                if self._token:
                    headers["Authorization"] = self._token
                conn.request("POST", path, body=data, headers=headers)
                response = conn.getresponse()
                payload = response.read()
                status = response.status
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                self._local.conn = None
                last = exc
                attempt += 1
                if time.monotonic() >= deadline:
                    host, port = self.config.endpoints[index]
                    raise EtcdUnavailableError(
                        f"etcd unreachable ({', '.join(f'{h}:{p}' for h, p in self.config.endpoints)}): "
                        f"{type(last).__name__}: {last} (last tried {host}:{port})") from None
                if attempt % endpoints == 0:
                    time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
                continue
            self._preferred = index
            try:
                reply = json.loads(payload or b"{}")
            except ValueError:
                raise EtcdError(f"etcd at {self.config.endpoints[index][0]}:{self.config.endpoints[index][1]} "
                                f"answered {status} with something that is not JSON") from None
            if status != 200 or (isinstance(reply, dict) and "error" in reply and "code" in reply):
                message = reply.get("message") or reply.get("error") if isinstance(reply, dict) else payload[:200]
                expired = status == 401 or "invalid auth token" in str(message)
                if self.config.user and expired and path != "/v3/auth/authenticate" and not retried:
                    self._authenticate(refresh=True)  # etcd's tokens expire (--auth-token-ttl): once more
                    return self.call(path, body, read_timeout, retried=True)
                raise EtcdError(f"etcd {path}: {message} (HTTP {status})")
            if not isinstance(reply, dict):
                raise EtcdError(f"etcd {path}: unexpected reply")
            return reply

    def _authenticate(self, refresh: bool = False) -> None:
        with self._token_lock:
            if self._token and not refresh:
                return
            try:
                with open(self.config.password_file, encoding="utf-8") as handle:
                    password = handle.read().strip()
            except OSError as exc:
                raise EtcdConfigError(f"cannot read etcd_password_file {self.config.password_file!r}: "
                                      f"{exc.strerror}") from None
            self._token = ""
            reply = self.call("/v3/auth/authenticate", {"name": self.config.user, "password": password})
            self._token = str(reply.get("token", ""))

    def start(self) -> None:
        if self.config.user:
            self._authenticate()


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` in etcd under ``namespace`` (see the module's docstring).

    ``timeout`` bounds ``get``/``wait`` (as TCPStore's), ``connect_timeout`` how long a request
    keeps trying the endpoints before :class:`EtcdUnavailableError`."""

    def __init__(self, config: EtcdConfig, namespace: str, timeout: float = 300.0,
                 connect_timeout: float = 30.0) -> None:
        super().__init__()
        if not namespace.endswith("/"):
            namespace += "/"
        self.config = config
        self.namespace = namespace
        self.connect_timeout = connect_timeout
        self._client = _Client(config, connect_timeout)
        self._client.start()
        self.set_timeout(datetime.timedelta(seconds=timeout))
        with _KEEP_LOCK:
            _KEEP_ALIVE.append(self)

    @classmethod
    def for_job(cls, config: EtcdConfig, run_id: str, timeout: float = 300.0,
                connect_timeout: float = 30.0) -> EtcdStore:
        return cls(config, f"{NAMESPACE_ROOT}{quote(run_id, safe='')}/", timeout, connect_timeout)

    def clone(self) -> EtcdStore:
        """Another store on the same namespace with connections of its own."""
        return EtcdStore(self.config, self.namespace, self.timeout.total_seconds(), self.connect_timeout)

    def _key(self, key: str) -> str:
        return _b64(self.namespace + key)

    def _range(self, key: str) -> Optional[dict[str, Any]]:
        reply = self._client.call("/v3/kv/range", {"key": self._key(key)})
        kvs = reply.get("kvs") or []
        return kvs[0] if kvs else None

    def _deadline(self, timeout: Optional[datetime.timedelta] = None) -> float:
        span = (timeout if timeout is not None else self.timeout).total_seconds()
        return time.monotonic() + (span if span > 0 else 1e9)

    # -- torch.distributed.Store ------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self._client.call("/v3/kv/put", {"key": self._key(key), "value": _b64(_as_bytes(value))})

    def get(self, key: str) -> bytes:
        deadline = self._deadline()
        pause = _POLL
        while True:
            kv = self._range(key)
            if kv is not None:
                return _unb64(kv.get("value", ""))
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"Wait timeout: key {key!r} not set within {self.timeout.total_seconds():g} s")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)

    def check(self, keys: Sequence[str]) -> bool:
        return all(self._range(key) is not None for key in keys)

    def wait(self, keys: Sequence[str], timeout: Optional[datetime.timedelta] = None) -> None:
        deadline = self._deadline(timeout)
        pause = _POLL
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"Wait timeout: keys {list(keys)} not all set")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)

    def add(self, key: str, amount: int) -> int:
        while True:
            kv = self._range(key)
            if kv is None:
                value = amount
                compare = {"key": self._key(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            else:
                current = _unb64(kv.get("value", ""))
                try:
                    value = int(current or b"0") + amount
                except ValueError:
                    raise EtcdError(f"add on {key!r}: its value {current[:32]!r} is not a counter") from None
                if amount == 0:
                    return value
                compare = {"key": self._key(key), "target": "MOD", "result": "EQUAL",
                           "mod_revision": kv.get("mod_revision", "0")}
            if self._txn([compare], [_put(self._key(key), str(value).encode())]):
                return value

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        expected_raw, desired_raw = _as_bytes(expected), _as_bytes(desired)
        while True:
            kv = self._range(key)
            if kv is None:
                if expected_raw:
                    return expected_raw
                compare = {"key": self._key(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            else:
                current = _unb64(kv.get("value", ""))
                if current != expected_raw:
                    return current
                compare = {"key": self._key(key), "target": "MOD", "result": "EQUAL",
                           "mod_revision": kv.get("mod_revision", "0")}
            if self._txn([compare], [_put(self._key(key), desired_raw)]):
                return desired_raw

    def delete_key(self, key: str) -> bool:
        reply = self._client.call("/v3/kv/deleterange", {"key": self._key(key)})
        return int(reply.get("deleted", "0")) > 0

    deleteKey = delete_key  # the name torch's C++ store calls

    def num_keys(self) -> int:
        prefix = (self.namespace).encode()
        reply = self._client.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
                                                   "count_only": True})
        return int(reply.get("count", "0"))

    getNumKeys = num_keys

    # -- leases (leadership, liveness) -----------------------------------------------------------

    def grant_lease(self, ttl: float) -> int:
        reply = self._client.call("/v3/lease/grant", {"TTL": max(1, int(round(ttl)))})
        return int(reply["ID"])

    def keep_alive(self, lease: int) -> float:
        """Renew ``lease``; its remaining TTL in seconds (0 or less: it expired)."""
        reply = self._client.call("/v3/lease/keepalive", {"ID": str(lease)})
        result = reply.get("result", reply)
        return float(result.get("TTL", 0) or 0)

    def revoke_lease(self, lease: int) -> None:
        self._client.call("/v3/lease/revoke", {"ID": str(lease)})

    def create(self, key: str, value: Any, lease: int = 0) -> bool:
        """Write ``key`` only if it does not exist (bound to ``lease`` when given): True if written."""
        put = _put(self._key(key), _as_bytes(value), lease)
        compare = {"key": self._key(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        return self._txn([compare], [put])

    def put(self, key: str, value: Any, lease: int = 0) -> None:
        """``set`` bound to a lease: the key disappears when the lease expires."""
        self._client.call("/v3/kv/put", _put(self._key(key), _as_bytes(value), lease)["request_put"])

    def list_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` (relative to the namespace) with its value."""
        raw = (self.namespace + prefix).encode()
        reply = self._client.call("/v3/kv/range", {"key": _b64(raw), "range_end": _b64(_prefix_end(raw))})
        cut = len(self.namespace.encode())
        return {_unb64(kv["key"])[cut:].decode(): _unb64(kv.get("value", "")) for kv in reply.get("kvs") or []}

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]]) -> bool:
        reply = self._client.call("/v3/kv/txn", {"compare": compare, "success": success})
        return bool(reply.get("succeeded", False))


def _put(key_b64: str, value: bytes, lease: int = 0) -> dict[str, Any]:
    request: dict[str, Any] = {"key": key_b64, "value": _b64(value)}
    if lease:
        request["lease"] = str(lease)
    return {"request_put": request}


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):  # torch hands std::vector<uint8_t> over as a list of ints
        return bytes(value)
    return str(value).encode()

"""Parsing and opening the rendezvous endpoint (the store every agent talks to)."""

from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass
from datetime import timedelta

import psutil
from torch.distributed import TCPStore


class EndpointError(ValueError):
    """The rendezvous endpoint is malformed or cannot be reached."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str, default_port: int) -> Endpoint:
    """Parse ``host``, ``host:port`` or ``[v6]:port``; raise EndpointError with a clear reason."""
    text = text.strip()
    if not text:
        raise EndpointError("the rendezvous endpoint is empty")
    host, port_text = text, ""
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise EndpointError(f"malformed rendezvous endpoint {text!r}: missing ']'")
        host, rest = text[1:close], text[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise EndpointError(f"malformed rendezvous endpoint {text!r}")
            port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif text.count(":") > 1:
        raise EndpointError(f"malformed rendezvous endpoint {text!r}: write an IPv6 host as [addr]:port")
    if not host:
        raise EndpointError(f"malformed rendezvous endpoint {text!r}: no host")
    if port_text == "":
        port = default_port
    else:
        if not port_text.isdigit():
            raise EndpointError(f"malformed rendezvous endpoint {text!r}: port {port_text!r} is not a number")
        port = int(port_text)
    if not 0 <= port <= 65535:
        raise EndpointError(f"malformed rendezvous endpoint {text!r}: port {port} is out of range")
    return Endpoint(host, port)


def resolve(host: str) -> set[str]:
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as exc:
        raise EndpointError(f"cannot resolve rendezvous host {host!r}: {exc.strerror}") from None
    return {str(info[4][0]) for info in infos}


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine (so this agent may host the store)."""
    addresses = resolve(host)
    if any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return True
    local = {snic.address.split("%")[0] for nics in psutil.net_if_addrs().values() for snic in nics}
    return bool(addresses & local)


def open_store(
    endpoint: Endpoint, *, connect_timeout: float, op_timeout: float, may_host: bool = True
) -> tuple[TCPStore, bool, int]:
    """Host the store when the endpoint is this machine and its port is free, else connect.

    Returns (store, hosted_here, port). A port of 0 always hosts (standalone).
    """
    if endpoint.port == 0 and not may_host:
        raise EndpointError("port 0 means 'host the store here', which is_host=false forbids")
    if may_host and is_local_host(endpoint.host):
        try:
            store = TCPStore(
                endpoint.host,
                endpoint.port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=op_timeout),
                multi_tenant=False,
            )
            return store, True, store.port
        except Exception as exc:  # torch raises DistNetworkError/RuntimeError
            if endpoint.port == 0 or not _is_address_in_use(exc):
                raise EndpointError(f"cannot host the rendezvous store on {endpoint}: {exc}") from None
    try:
        store = TCPStore(
            endpoint.host,
            endpoint.port,
            is_master=False,
            timeout=timedelta(seconds=connect_timeout),
        )
    except Exception:
        raise EndpointError(
            f"cannot reach the rendezvous endpoint {endpoint} within {connect_timeout:g} s"
        ) from None
    store.set_timeout(timedelta(seconds=op_timeout))
    return store, False, endpoint.port


def _is_address_in_use(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "address already in use" in text or f"errno: {errno.EADDRINUSE}" in text or "eaddrinuse" in text

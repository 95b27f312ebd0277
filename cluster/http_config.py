"""The HTTP gateway's settings in a preset's [serve] table (the ZeroMQ front door reads none of them): the admin
routes' bearer token and the networks trusted to call them without one (docs/http.md, "Admin routes"), and what
SGLang's `/server_info` reports as `enable_memory_saver` (docs/http.md, "SGLang's native routes")."""

from __future__ import annotations

import ipaddress
import os
from typing import Any

HTTP_ADMIN_TOKEN_ENV = "LOCKSTEP_HTTP_ADMIN_TOKEN"
# [serve] keys the HTTP gateway reads
HTTP_SERVE_KEYS = ("http_admin_token", "http_admin_trust", "sglang_enable_memory_saver")
LOOPBACK = "loopback"  # http_admin_trust's name for 127.0.0.0/8 and ::1
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")


def http_admin_token(serve_table: dict[str, Any] | None) -> str | None:
    """The HTTP admin routes' bearer token: env LOCKSTEP_HTTP_ADMIN_TOKEN, else [serve] `http_admin_token`, or None."""
    token = os.environ.get(HTTP_ADMIN_TOKEN_ENV) or (serve_table or {}).get("http_admin_token")
    if token is not None and not isinstance(token, str):
        raise ValueError("[serve] http_admin_token must be a string")
    return token or None


def admin_trust_networks(entries: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The networks `entries` name, as CIDR strings: "loopback" is LOOPBACK_NETWORKS, an address or a network
    (`10.0.0.0/8`, `::1`) is itself; a string is one entry, or several separated by commas. ValueError naming a
    bad entry. Empty or None: no network is trusted (the default)."""
    if entries is None:
        return ()
    if isinstance(entries, str):
        entries = [e for e in (part.strip() for part in entries.split(",")) if e]
    if not isinstance(entries, (list, tuple)) or not all(isinstance(e, str) for e in entries):
        raise ValueError(f"[serve] http_admin_trust = {entries!r}: expected \"loopback\", a network such as "
                         f"\"10.0.0.0/8\", or a list of them")
    networks: list[str] = []
    for entry in entries:
        if entry == LOOPBACK:
            networks += LOOPBACK_NETWORKS
            continue
        try:
            networks.append(str(ipaddress.ip_network(entry, strict=False)))
        except ValueError as e:
            raise ValueError(f"[serve] http_admin_trust: {entry!r} is neither \"loopback\" nor an address or "
                             f"network ({e})") from None
    return tuple(dict.fromkeys(networks))


def http_admin_trust(serve_table: dict[str, Any] | None) -> tuple[str, ...]:
    """[serve] `http_admin_trust`: the networks whose callers reach the HTTP admin routes without the bearer token
    (admin_trust_networks); unset, none (off)."""
    return admin_trust_networks((serve_table or {}).get("http_admin_trust"))


def sglang_enable_memory_saver(serve_table: dict[str, Any] | None) -> bool:
    """[serve] `sglang_enable_memory_saver`: what SGLang's `/server_info` reports as `enable_memory_saver` (SGLang's
    server argument, false by default, as here). slime checks it against its `--offload-rollout`; Lockstep releases
    memory either way, so it only states what the operator told the trainer. ValueError unless a bool."""
    value = (serve_table or {}).get("sglang_enable_memory_saver", False)
    if not isinstance(value, bool):
        raise ValueError(f"[serve] sglang_enable_memory_saver = {value!r}: expected true or false")
    return value

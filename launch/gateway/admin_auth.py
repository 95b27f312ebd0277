"""Who may call the gateway's admin routes (its own, SGLang's and TRL's that change the server's state): a caller with
`Authorization: Bearer <token>` (the admin token, cluster/http_config.py `http_admin_token`), or, when the preset
trusts networks (`http_admin_trust`, off by default), any caller whose address is in one of them: RL clients
(slime, AReaL, verl, TRL) send no token. The address is the TCP peer's: the gateway runs uvicorn without proxy
headers, so no X-Forwarded-For can claim a trusted address. Torch-free."""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Any

from launch.gateway.errors import ADMIN_TOKEN_UNSET, UNAUTHORIZED, HttpError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_address(host: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address (an IPv4-mapped IPv6 one as its IPv4 address, `localhost` as 127.0.0.1), or None for a name."""
    if host == "localhost":
        return ipaddress.IPv4Address("127.0.0.1")
    try:
        address = ipaddress.ip_address((host or "").strip("[]").split("%")[0])
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def peer_trusted(host: str | None, networks: tuple[Network, ...]) -> bool:
    """Whether a caller at `host` is inside one of `networks` (a name that is not an address never is)."""
    address = parse_address(host)
    return address is not None and any(address.version == n.version and address in n for n in networks)


def bind_warning(listen_host: str, networks: tuple[Network, ...]) -> str | None:
    """The warning a gateway listening on `listen_host` owes its operator when it trusts networks without a token
    on an address other than loopback (anyone who reaches the port from a trusted network is an admin); None
    otherwise."""
    address = parse_address(listen_host)
    if not networks or (address is not None and address.is_loopback):
        return None
    named = ", ".join(str(n) for n in networks)
    return (f"the HTTP gateway listens on {listen_host} and trusts {named} for its admin routes without a token: "
            f"any caller from there may pause, update weights, release memory and abort requests")


@dataclass(frozen=True)
class AdminAuth:
    """`token`: the bearer token (None: no token is accepted); `trusted`: the networks let in without one."""

    token: str | None = None
    trusted: tuple[Network, ...] = ()

    @classmethod
    def of(cls, token: str | None, trust: tuple[str, ...] = ()) -> "AdminAuth":
        """From the settings: the token, and the trusted networks as CIDR strings (cluster/http_config.py)."""
        return cls(token, tuple(ipaddress.ip_network(n, strict=False) for n in trust))

    def check(self, request: Any) -> None:
        """HttpError unless the request comes from a trusted network or carries the admin bearer token."""
        client = getattr(request, "client", None)
        if self.trusted and peer_trusted(client.host if client is not None else None, self.trusted):
            return
        if self.token is None:
            raise HttpError(ADMIN_TOKEN_UNSET, "admin routes are off: no [serve] http_admin_token (or "
                                               "LOCKSTEP_HTTP_ADMIN_TOKEN) is configured, and this caller is not "
                                               "in a network of [serve] http_admin_trust")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            raise HttpError(UNAUTHORIZED, "admin routes need 'Authorization: Bearer <token>' with the admin token")

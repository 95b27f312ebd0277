"""Who may run the admin operations (`pause`, `resume`, `update_weights`) at the front door, and who holds the
pause (the rules: docs/protocol.md, "Admin operations")."""

from __future__ import annotations

import ipaddress
import logging
from typing import Any, Callable

from cluster import protocol as P
from cluster.errors import Code

log = logging.getLogger("lockstep")


def binds_locally(address: str) -> bool:
    """True for ipc:// and for tcp binds on a loopback address (127.0.0.0/8, localhost, [::1])."""
    if address.startswith("ipc://"):
        return True
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a wildcard or an interface name: reachable from elsewhere


class CurveKeys:
    """The authenticator's credentials provider: admits the keys of both folders, knows which are admins."""

    def __init__(self, allowed_dir: str, admin_dir: str | None):
        from zmq.auth import load_certificates

        self.allowed = set(load_certificates(allowed_dir))
        self.admins = set(load_certificates(admin_dir)) if admin_dir else set()

    def callback(self, domain: str, key: bytes) -> bool:  # key: z85-encoded public key
        return key in self.allowed or key in self.admins

    def is_admin(self, user_id: str | None) -> bool:
        return user_id is not None and user_id.encode("ascii", "replace") in self.admins


class AdminPolicy:
    def __init__(self, enabled: bool, bound_address: str, curve_keys: CurveKeys | None):
        self.enabled, self.curve_keys, self.local = enabled, curve_keys, binds_locally(bound_address)

    def check(self, user_id: Callable[[], str | None], mid: Any) -> None:
        """Raise ProtocolError unless the sender may run admin operations (`user_id` is read only with CURVE)."""
        if not self.enabled:
            raise P.ProtocolError(Code.ADMIN_DISABLED, "admin operations are turned off on this server "
                                                       "([serve] admin = false)", mid)
        if self.curve_keys is not None:
            if self.curve_keys.is_admin(user_id()):
                return
            raise P.ProtocolError(Code.ADMIN_REQUIRED, "admin operations need a key in curve_admin_clients_dir", mid)
        if not self.local:
            raise P.ProtocolError(Code.ADMIN_REQUIRED, "admin operations need CURVE admin keys on a server that "
                                                       "does not bind loopback or ipc", mid)


class PauseOwner:
    """The client holding the serving pause (None: not paused); `hold(bool, mode, done)` is manager.hold_scheduling."""

    def __init__(self, hold: Callable[..., None]):
        self.hold, self.owner = hold, None

    def pause(self, ident: bytes, mid: Any, mode: str = "keep", done: Callable[[bool], None] | None = None) -> None:
        """`mode`: docs/weights.md, "Pause modes"; `done(in_force)` from the loop thread once the pause is in force."""
        self._check(ident, mid, "pause")
        self.owner = ident
        self.hold(True, mode, done)

    def resume(self, ident: bytes, mid: Any) -> None:
        self._check(ident, mid, "resume")
        self.release(ident)

    def release(self, ident: bytes) -> None:
        """The owner resumed, said bye, went silent or disconnected: scheduling goes on."""
        if self.owner == ident:
            self.owner = None
            self.hold(False)

    def _check(self, ident: bytes, mid: Any, what: str) -> None:
        if self.owner is not None and self.owner != ident:
            raise P.ProtocolError(Code.NOT_PAUSE_OWNER, f"{what}: another client holds the pause", mid)

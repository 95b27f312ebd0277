"""Who may call the HTTP admin routes (launch/gateway/admin_auth.py, cluster/http_config.py), in process: the
preset's http_admin_trust (off by default) lets callers from its networks in without the bearer token, others still
need it; a non-loopback bind that trusts networks is warned about; bad entries are refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.http_config import HTTP_ADMIN_TOKEN_ENV, admin_trust_networks, http_admin_token, http_admin_trust
from launch.gateway.admin_auth import AdminAuth, bind_warning, peer_trusted
from launch.gateway.errors import ADMIN_TOKEN_UNSET, UNAUTHORIZED, HttpError


def request(host: str | None, token: str | None = None) -> SimpleNamespace:
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    return SimpleNamespace(client=SimpleNamespace(host=host) if host is not None else None, headers=headers)


def refusal(auth: AdminAuth, req: SimpleNamespace) -> str | None:
    try:
        auth.check(req)
    except HttpError as e:
        return e.code
    return None


def test_the_preset_key_off_by_default_and_validated(monkeypatch):
    monkeypatch.delenv(HTTP_ADMIN_TOKEN_ENV, raising=False)
    assert http_admin_trust(None) == http_admin_trust({}) == ()
    assert http_admin_trust({"http_admin_trust": "loopback"}) == ("127.0.0.0/8", "::1/128")
    assert http_admin_trust({"http_admin_trust": ["10.1.2.3/8", "loopback", "::1"]}) == (
        "10.0.0.0/8", "127.0.0.0/8", "::1/128")
    assert admin_trust_networks("loopback, 192.168.0.7") == ("127.0.0.0/8", "::1/128", "192.168.0.7/32")
    for bad in ("everyone", ["10.0.0.0/33"], 5, ["loopback", 7]):
        with pytest.raises(ValueError, match="http_admin_trust"):
            http_admin_trust({"http_admin_trust": bad})
    assert http_admin_token({"http_admin_token": "t"}) == "t"


def test_trusted_callers_need_no_token_the_others_do():
    open_local = AdminAuth.of(None, admin_trust_networks("loopback"))
    assert refusal(open_local, request("127.0.0.1")) is None
    assert refusal(open_local, request("127.9.8.7")) is None
    assert refusal(open_local, request("::1")) is None
    assert refusal(open_local, request("::ffff:127.0.0.1")) is None  # a dual-stack socket's IPv4 caller
    assert refusal(open_local, request("10.0.0.2")) == ADMIN_TOKEN_UNSET
    assert refusal(open_local, request("testclient")) == ADMIN_TOKEN_UNSET  # a name is never trusted
    assert refusal(open_local, request(None)) == ADMIN_TOKEN_UNSET

    both = AdminAuth.of("secret", admin_trust_networks(["10.0.0.0/8"]))
    assert refusal(both, request("10.3.4.5")) is None
    assert refusal(both, request("127.0.0.1")) == UNAUTHORIZED  # loopback is not trusted unless named
    assert refusal(both, request("127.0.0.1", "secret")) is None
    assert refusal(both, request("11.0.0.1", "wrong")) == UNAUTHORIZED

    off = AdminAuth.of("secret")  # the default: the token alone, from anywhere
    assert refusal(off, request("127.0.0.1")) == UNAUTHORIZED
    assert refusal(off, request("127.0.0.1", "secret")) is None
    assert refusal(AdminAuth(), request("127.0.0.1")) == ADMIN_TOKEN_UNSET


def test_a_non_loopback_bind_that_trusts_networks_is_warned_about():
    loopback = AdminAuth.of(None, admin_trust_networks("loopback")).trusted
    assert bind_warning("127.0.0.1", loopback) is None and bind_warning("::1", loopback) is None
    assert bind_warning("localhost", loopback) is None
    assert "0.0.0.0" in bind_warning("0.0.0.0", loopback) and "127.0.0.0/8" in bind_warning("0.0.0.0", loopback)
    assert bind_warning("10.0.0.5", loopback) is not None and bind_warning("gateway.example", loopback) is not None
    assert bind_warning("0.0.0.0", ()) is None  # no trust: nothing to warn about
    assert peer_trusted("[::1]", loopback) and not peer_trusted("::2", loopback)


def test_the_gateways_settings_and_its_child_carry_the_trust(monkeypatch):
    import argparse

    from launch.gateway.child import GatewayProcess
    from launch.gateway.server import add_arguments, settings_for

    monkeypatch.delenv(HTTP_ADMIN_TOKEN_ENV, raising=False)
    preset = {"serve": {"http_admin_trust": "loopback", "http_admin_token": "t"}}
    assert settings_for(None, None, preset).admin_trust == ("127.0.0.0/8", "::1/128")
    assert settings_for(None, None, preset, "10.0.0.0/8").admin_trust == ("10.0.0.0/8",)  # --admin-trust wins
    assert settings_for(None, None, {}).admin_trust == ()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--admin-trust", "loopback"]).admin_trust == "loopback"
    child = GatewayProcess("tcp://127.0.0.1:1", "127.0.0.1:1", None, "t", ("127.0.0.0/8", "::1/128"))
    assert child.command[-2:] == ["--admin-trust", "127.0.0.0/8,::1/128"] and "t" not in child.command
    assert "--admin-trust" not in GatewayProcess("tcp://127.0.0.1:1", "127.0.0.1:1", None, None).command

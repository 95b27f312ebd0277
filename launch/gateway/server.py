"""The HTTP gateway (launch/gateway/app.py) under uvicorn: `lockstep http` as its own process (launch/gateway/child.py
starts it from rank 0), or in a thread of the launcher's process (`--launcher ray`, replicas). It prints
`http http://HOST:PORT` once it listens."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import threading

from cluster.config import read_preset
from cluster.http_config import admin_trust_networks, http_admin_token, http_admin_trust, sglang_enable_memory_saver
from cluster.protocol import DEFAULT_ADDRESS

log = logging.getLogger("lockstep")


def parse_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 hosts in brackets) as (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--http/--listen wants HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


def bind_listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) as uvicorn binds one (SO_REUSEADDR); OSError when it cannot be."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class Gateway:
    """One gateway: an AsyncClient of `address` and a uvicorn server on `listen`."""

    def __init__(self, address: str, listen: str, settings, parent_pid: int | None = None):
        """`parent_pid`: leave once this process's parent is no longer that pid (`--exit-with-parent`)."""
        self.address, (self.host, self.port), self.settings = address, parse_listen(listen), settings
        self.parent_pid, self.server = parent_pid, None
        self.started = threading.Event()
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def serve(self) -> None:
        import uvicorn

        from cluster.client import AsyncClient
        from launch.gateway.admin_auth import AdminAuth, bind_warning
        from launch.gateway.app import make_app, resolve_model

        client = AsyncClient(self.address)
        try:
            admin = AdminAuth.of(self.settings.admin_token, self.settings.admin_trust)
            if warning := bind_warning(self.host, admin.trusted):
                log.warning("%s", warning)
            app = make_app(client, await resolve_model(client, self.settings), admin,
                           self.settings.sglang_enable_memory_saver)
            # proxy_headers off: the admin trust reads the TCP peer, never a header (launch/gateway/admin_auth.py)
            self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                                        lifespan="off", timeout_graceful_shutdown=2,
                                                        proxy_headers=False))
            try:
                sock = bind_listen(self.host, self.port)
            except OSError as e:
                raise RuntimeError(f"the HTTP gateway cannot listen on {self.url}: {e.strerror or e}") from None
            task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
            while not self.server.started and not task.done():
                await asyncio.sleep(0.02)
            if self.server.started:
                print(f"http {self.url}", flush=True)
            self.started.set()
            while self.parent_pid is not None and not task.done():
                if os.getppid() != self.parent_pid:  # the parent is gone (killed outright): let the port go
                    log.warning("the HTTP gateway's parent (pid %s) is gone: stopping", self.parent_pid)
                    self.server.should_exit = True
                    break
                await asyncio.sleep(0.2)
            await task
        finally:
            self.started.set()
            await client.close()

    def run(self) -> None:
        """Serve in this thread until `stop` (its own event loop)."""
        try:
            asyncio.run(self.serve())
        except BaseException as e:  # reported by start_thread's caller, logged here
            self.error = e
            log.exception("http gateway failed")
            self.started.set()

    def start_thread(self, timeout: float = 120.0) -> "Gateway":
        """Serve from a daemon thread; returns once it listens (RuntimeError if it could not start)."""
        threading.Thread(target=self.run, name="lockstep-http", daemon=True).start()
        if not self.started.wait(timeout) or self.server is None or not self.server.started:
            raise RuntimeError(f"the HTTP gateway did not start on {self.url}: {self.error!r}")
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


def settings_for(model_dir: str | None, model_name: str | None, preset: dict, admin_trust: str | None = None,
                 memory_saver: bool = False):
    """The gateway's settings from a preset's [serve] table; `admin_trust` (--admin-trust) wins over its
    http_admin_trust; `memory_saver` (--sglang-enable-memory-saver) or its sglang_enable_memory_saver sets SGLang's
    `enable_memory_saver`."""
    from launch.gateway.app import GatewaySettings

    serve = preset.get("serve")
    trust = admin_trust_networks(admin_trust) if admin_trust is not None else http_admin_trust(serve)
    return GatewaySettings(model_dir, model_name, http_admin_token(serve), trust,
                           memory_saver or sglang_enable_memory_saver(serve))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_ADDRESS, help="the driver's ZeroMQ address")
    p.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT to serve HTTP on")
    p.add_argument("--model", help="the checkpoint directory (name and tokenizer); default: the server's")
    p.add_argument("--model-name", help="the model name clients send (default: the checkpoint directory's name)")
    p.add_argument("--config", help="a TOML preset; its [serve] http_admin_token protects the admin routes")
    p.add_argument("--admin-trust", metavar="NETS",
                   help="callers from these networks reach the admin routes without the token: \"loopback\" or "
                        "CIDRs, comma-separated (default: the preset's [serve] http_admin_trust; docs/http.md)")
    p.add_argument("--sglang-enable-memory-saver", action="store_true",
                   help="SGLang's /server_info reports enable_memory_saver true, as slime's --offload-rollout wants "
                        "(default: the preset's [serve] sglang_enable_memory_saver; docs/http.md)")
    p.add_argument("--exit-with-parent", type=int, metavar="PID",
                   help="stop when this process's parent is no longer PID (how `lockstep serve --http` runs it)")


def start_beside(address: str, args: argparse.Namespace) -> Gateway | None:
    """The gateway of `lockstep serve --http` in the Ray launcher's process, in front of `address` (or None)."""
    if not getattr(args, "http", None):
        return None
    return Gateway(address, args.http, settings_for(args.model, None, read_preset(args.config))).start_thread()


def run(args: argparse.Namespace) -> int:
    """`lockstep http`: the gateway as its own process, until interrupted."""
    logging.basicConfig(level=logging.INFO)
    try:
        settings = settings_for(args.model, args.model_name, read_preset(args.config), args.admin_trust,
                                args.sglang_enable_memory_saver)
    except ValueError as e:
        log.error("%s", e)
        return 2
    gateway = Gateway(args.address, args.listen, settings, parent_pid=args.exit_with_parent)
    try:
        asyncio.run(gateway.serve())
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    return 0

"""The client library: `Client` and `AsyncClient` (client.py), the I/O thread that owns the socket (io_thread.py),
the requests as a client sees them (pending.py) and their resume after a crash (resume.py). Never imports torch."""

from cluster.client.client import AsyncClient, Client

__all__ = ["AsyncClient", "Client"]

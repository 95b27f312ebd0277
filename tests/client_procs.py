"""What the client processes of the TP=2 tests run (tests/clients.py's run_clients and other spawn children).

A spawn child imports the module of the function it runs: this one imports the client and nothing heavy, so a
child starts in a fraction of a second instead of importing torch and transformers through a test module's
conftest (about 3 CPU-s a child, 8 at a time in test_serving)."""

from __future__ import annotations

import os
import threading
import time

from cluster.client import Client
from cluster.outputs import RequestStatus

CLIENTS, PER_CLIENT = 4, 16


def request(client_no: int, i: int) -> dict:
    """Request i of client `client_no`: streaming on even i, seeded sampling on every other pair, mixed lengths."""
    params = {"request_id": f"c{client_no}-r{i}", "max_new_tokens": 12 + (17 * i + 29 * client_no) % 40,
              "eos_token_id": -1, "streaming": i % 2 == 0}
    if (i // 2) % 2 == 0:
        params |= {"do_sample": True, "temperature": 0.8, "top_k": 40, "seed": 1000 * client_no + i}
    return {"input_ids": [1, 3 + client_no, 7 + i, 11 + (i * client_no) % 50], **params}


def one_client(address: str, client_no: int) -> dict:
    """A client process: its 16 requests at once; per request the final tokens, versions and resume count, and
    whether its stream (if it streamed) delivered every token once, in order."""
    results: dict[str, dict] = {}
    with Client(address, timeout=300, server_timeout_s=3.0, resume_timeout_s=180) as c:
        def run(spec: dict) -> None:
            try:
                attempt(dict(spec))
            except Exception as e:  # noqa: BLE001  (reported with the request, so the test says which failed)
                results[spec["request_id"]] = {"error": f"{type(e).__name__}: {e}", "status": -1}

        def attempt(spec: dict) -> None:
            rid, ids = spec.pop("request_id"), spec.pop("input_ids")
            if spec.pop("streaming"):
                seen: list[int] = []
                ok = True
                for out in c.stream(ids, request_id=rid, **spec):
                    ok &= out.generated_tokens[:len(seen)] == seen and len(out.generated_tokens) > len(seen)
                    seen = out.generated_tokens
                results[rid] = {"tokens": out.generated_tokens, "versions": out.weight_versions,
                                "resumes": out.resumes, "status": int(out.status), "stream_ok": ok}
            else:
                out = c.generate(ids, request_id=rid, **spec)
                results[rid] = {"tokens": out.generated_tokens, "versions": out.weight_versions,
                                "resumes": out.resumes, "status": int(out.status), "stream_ok": True}

        threads = [threading.Thread(target=run, args=(request(client_no, i),)) for i in range(PER_CLIENT)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results


def hammer(address: str, client_no: int, n: int) -> int:
    """One client process: n concurrent requests; how many finished."""
    with Client(address, timeout=300) as c:
        rids = [c.submit([1, 3 + client_no, 5 + i % 50], max_new_tokens=4) for i in range(n)]
        return sum(c.result(r).status == RequestStatus.FINISHED for r in rids)


def abandon(address: str) -> None:
    """A client that submits a long request and dies without saying goodbye."""
    c = Client(address)
    c.submit([1, 2, 3], max_new_tokens=800)
    os._exit(0)


def exit_or_sleep(code: int | None) -> int:
    """A child that exits at once with `code` (a crash, as run_clients sees one), or sleeps for two minutes."""
    if code is not None:
        os._exit(code)
    time.sleep(120)
    return 0

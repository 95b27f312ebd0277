"""A trainer process that makes slime's calls, in slime's order (slime/backends/megatron_utils/update_weight/
update_weight_from_distributed.py and slime/backends/sglang_utils/sglang_engine.py), against one engine over HTTP:

- connect: POST /init_weights_update_group {master_address, master_port, rank_offset: 1, world_size: tp + 1,
  group_name: "slime-pp_0", backend} sent while the trainer itself joins at rank 0 (`init_process_group`, the store's
  master), then the call's answer checked;
- each update (weight_version counting from 1, sent as a string): POST /pause_generation {}, GET /flush_cache until
  200, then per bucket of at most `buffer_bytes` (slime's update_weight_buffer_size; its _iter_non_expert_chunks
  closes a bucket when the next tensor would pass it): POST
  /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache: false, weight_version} sent while
  the trainer broadcasts the bucket's tensors one by one, the answer checked after; POST /continue_generation {};
- disconnect: POST /destroy_weights_update_group {group_name} while it destroys its own group.

Runs as its own process (rank 0 of the group, gloo); commands come over a pipe: ("update", checkpoint_dir) and
("stop",); each reply is the list of (route, status, answer) it saw, or the exception's text."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any

GROUP = "slime-pp_0"


def post(base: str, token: str, path: str, body: dict | None = None, method: str = "POST") -> tuple[int, Any]:
    """slime's `_make_request` (requests.post(url, json=payload or {})), with the admin token this test's gateway
    asks for."""
    req = urllib.request.Request(base + path, method=method,
                                 data=None if method == "GET" else json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Call(threading.Thread):
    """An HTTP call in flight while the trainer does its side (slime's `engine.<call>.remote(...)`, then ray.get)."""

    def __init__(self, *args: Any):
        super().__init__(daemon=True)
        self.args, self.answer = args, None
        self.start()

    def run(self) -> None:
        self.answer = post(*self.args)

    def result(self) -> tuple[int, Any]:
        self.join(180)
        return self.answer


def run(base: str, token: str, tp: int, port: int, conn: Any, buffer_bytes: int = 2 << 20) -> None:
    from safetensors.torch import load_file

    from launch.weight_push import buckets_of  # slime's chunks, for tensors of one dtype
    from tests.trainer_recipe import broadcast_tensors, dtype_name, init_process_group

    log: list = []
    init = Call(base, token, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": tp + 1,
        "group_name": GROUP, "backend": "gloo"})
    group = init_process_group("gloo", f"tcp://127.0.0.1:{port}", tp + 1, 0, GROUP)
    log.append(("/init_weights_update_group", *init.result()))
    conn.send(log)
    version = 0
    while (command := conn.recv())[0] == "update":
        log, version = [], version + 1
        try:
            log.append(("/pause_generation", *post(base, token, "/pause_generation", {})))
            while (flushed := post(base, token, "/flush_cache", method="GET"))[0] != 200:  # slime retries
                time.sleep(0.2)
            log.append(("/flush_cache", *flushed))
            state = load_file(os.path.join(command[1], "model.safetensors"))
            for names in buckets_of(state, buffer_bytes):
                bucket = [(n, state[n]) for n in names]
                call = Call(base, token, "/update_weights_from_distributed", {
                    "names": [n for n, _ in bucket], "dtypes": [dtype_name(t) for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "group_name": GROUP, "flush_cache": False,
                    "weight_version": str(version)})
                broadcast_tensors(group, [t for _, t in bucket])
                log.append(("/update_weights_from_distributed", *call.result()))
            log.append(("/continue_generation", *post(base, token, "/continue_generation", {})))
        except Exception as e:  # the test reads it
            log.append(("raised", 0, f"{type(e).__name__}: {e}"))
        conn.send(log)
    import torch.distributed as dist

    destroy = Call(base, token, "/destroy_weights_update_group", {"group_name": GROUP})
    dist.destroy_process_group(group)
    conn.send([("/destroy_weights_update_group", *destroy.result())])

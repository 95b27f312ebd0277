"""A Ray job (tests/test_replicas.py submits it): it finds the running service by its ServiceHandle actor,
takes a client from it, and prints one JSON line with the greedy tokens of each prompt given."""

from __future__ import annotations

import json
import sys

import ray

from launch.router.replicas import SERVICE_NAMESPACE


def main(name: str, prompts: list[list[int]], new: int) -> None:
    ray.init()  # the job's Ray (RAY_ADDRESS, set by the job supervisor)
    client = ray.get(ray.get_actor(name, namespace=SERVICE_NAMESPACE).client.remote())
    with client:
        outs = [client.generate(p, max_new_tokens=new).generated_tokens for p in prompts]
    print("JOB-RESULT " + json.dumps(outs), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))

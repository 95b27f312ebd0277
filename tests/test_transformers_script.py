"""docs/examples/transformers_api.py, written for transformers' continuous batching, runs unchanged on
Lockstep (TP=1 and TP=2) and prints the same tokens."""

from __future__ import annotations

import pytest
import json
import subprocess
import sys

from tests.conftest import REPO, run_ranks

SCRIPT = REPO / "docs" / "examples" / "transformers_api.py"


def last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


@pytest.mark.slow
def test_same_script_same_tokens(make_checkpoint):
    path = str(make_checkpoint("llama"))
    runs = {}
    for engine in ("transformers", "lockstep"):
        proc = subprocess.run([sys.executable, str(SCRIPT), engine, path], capture_output=True, text=True,
                              timeout=300, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[engine] = last_json(proc.stdout)
    assert runs["lockstep"] == runs["transformers"]
    assert len(runs["lockstep"]["batch"]) == 3 and runs["lockstep"]["after_pause"]

    # the example is meant for torchrun: run it from its real path, two ranks
    tp2 = run_ranks(str(SCRIPT), ["lockstep", path], torchrun=True)  # as its users run it
    assert tp2.returncode == 0, tp2.stdout[-3000:]
    assert last_json(tp2.stdout) == runs["transformers"]

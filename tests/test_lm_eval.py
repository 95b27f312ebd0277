"""lm-evaluation-harness against the shared TP=2 `lockstep serve --http` (issue 33): its `local-completions` model, with
token requests and with text requests, runs a multiple-choice task, a rolling-perplexity task and a generate_until
task (tests/lm_eval_tasks: local JSONL, nothing downloaded), and every sample's loglikelihood equals lm-eval's own
`hf` backend on the same checkpoint (float32) within 1e-3, every generated string the same.

lm-eval's API models encode without BOS unless `add_bos_token`, its hf backend with the tokenizer's default, which
prepends BOS for this tokenizer: with add_bos_token=True both score the same tokens. A text request is those tokens
decoded (BOS included) and encoded again by the server, whose gateway gives such a prompt no second BOS
(`Model.prompt_source` in launch/gateway/openai_serving.py; tests/test_http_shapes.py in process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from tests.test_http import model_dir, server  # noqa: F401  (the shared fixtures: one server for the HTTP modules)

pytestmark = pytest.mark.slow  # the shared TP=2 server

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TASKS = ("lockstep_mc", "lockstep_rolling", "lockstep_gen")
DOCS = {"lockstep_mc": 4, "lockstep_rolling": 2, "lockstep_gen": 4}
TOLERANCE = 1e-3

Samples = dict[str, list[list[Any]]]  # task -> each doc's responses: loglikelihoods, or the generated string


@pytest.fixture(scope="module")
def evaluate() -> Callable[..., Samples]:
    """lm_eval.simple_evaluate on the local tasks, offline, in this process: each task's per-sample responses."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        import lm_eval
        from lm_eval import evaluator
        from lm_eval.tasks import TaskManager

        # torch's collect_env runs pip and the like for the results' report: seconds that tell nothing here
        mp.setattr(evaluator, "add_env_info", lambda results: None)
        tasks = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)

        def run(model: str, model_args: dict[str, Any], batch_size: int) -> Samples:
            # greedy throughout: the worker's global random generators are left as they are; no stderr bootstrap
            results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS),
                                              task_manager=tasks, batch_size=batch_size, device="cpu",
                                              log_samples=True, bootstrap_iters=0, random_seed=None,
                                              numpy_random_seed=None, torch_random_seed=None)
            return {task: [[response(r) for r in s["resps"]]
                           for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])] for task in TASKS}

        yield run


def response(r: list) -> Any:
    """One request's response: (loglikelihood, is_greedy) of a choice, a document's loglikelihood, or a string."""
    return r[0][0] if isinstance(r[0], (list, tuple)) else r[0]


@pytest.fixture(scope="module")
def reference(evaluate, model_dir) -> Samples:
    """lm-eval's `hf` backend: transformers on this checkpoint, float32, one request at a time (on the one OpenMP
    thread tests/conftest.py gives every test process)."""
    return evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32"}, 1)


def max_difference(got: Samples, want: Samples) -> float:
    """The largest loglikelihood difference; the generated strings must be equal."""
    worst = 0.0
    for task in TASKS:
        assert len(got[task]) == len(want[task]) == DOCS[task], task
        for doc, (g, w) in enumerate(zip(got[task], want[task])):
            assert len(g) == len(w), (task, doc)
            for a, b in zip(g, w):
                if isinstance(b, str):
                    assert a == b, (task, doc)
                else:
                    worst = max(worst, abs(a - b))
    return worst


@pytest.mark.parametrize("tokenized", [True, False], ids=["token-requests", "text-requests"])
def test_local_completions_equal_the_hf_backend(server, model_dir, evaluate, reference, tokenized):
    """Token requests in batches of 4 (prompts as lists of token id lists), text requests one string each; both 4 at
    a time, so the server batches them."""
    args = {"model": model_dir.name, "base_url": f"{server.http}/v1/completions", "tokenizer": str(model_dir),
            "tokenized_requests": tokenized, "add_bos_token": True, "num_concurrent": 4, "max_retries": 1}
    got = evaluate("local-completions", args, 4 if tokenized else 1)
    worst = max_difference(got, reference)
    print(f"lm-eval local-completions ({'token' if tokenized else 'text'} requests) against hf: "
          f"max |loglikelihood difference| {worst:.3g}")
    assert worst <= TOLERANCE

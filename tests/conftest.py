"""Shared fixtures: locally made checkpoints, transformers' greedy reference, a bounded torchrun runner, and the
TP=2 HTTP server the two HTTP modules share."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

# One OpenMP thread a test process, set before torch is imported: the suite runs three workers on two cores, and
# their ranks on top. With two threads each, torch's OpenMP barriers on the oversubscribed cores made in-process
# generates about 10x slower (the mixtral preempt scenario: 31 s against 2.9 s, beside one busy process); the ranks
# the tests start get one thread too (run_ranks, tests/serving.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launch.make_model import make_model  # noqa: E402
from launch.torchrun import free_port  # noqa: E402
from tests.local_ranks import run_local_ranks, ranks_base_env  # noqa: E402
from tests.workloads import NEW_TOKENS  # noqa: E402
from tests.process_guard import pytest_runtest_protocol  # noqa: E402,F401  (the fast tier starts no process)
from tests.ray_session import ray_head, ray_module  # noqa: E402,F401  (the Ray modules' one Ray)

_MODELS: dict[tuple, Path] = {}

# Each module's tests run on one xdist worker (pyproject: `--dist loadgroup`, a group a module), so its shared server
# starts once; the Ray modules share one group, since local Ray clusters started at once on one host confuse each
# other (a job of one failed to find an actor of its own cluster), and so one Ray (tests/ray_session.py). Groups go
# out longest first (their seconds on a fresh clone, cold caches), the rest in file order, so the workers finish
# together. Refresh from `--durations` when they drift.
RAY_MODULES = ("test_replicas", "test_ray", "test_recovery_ray")
# one group: one server (`http_server`)
HTTP_MODULES = ("test_http", "test_http_openai", "test_http_samples", "test_http_trl", "test_lm_eval")
LONGEST_FIRST = (*RAY_MODULES, "test_parity", "test_compile", "test_moe_parity", "test_recovery_chaos",
                 "test_chaos_loop", "test_gpu_compat", "test_chaos_frontend", "test_weight_push", "test_flood_latency",
                 "test_transformers_script",
                 "test_serving_security", "test_pause_modes", "test_speculative", "test_moe", "test_host_all_reduce",
                 "test_overlap", "test_serving", "test_http")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    module = {item: item.module.__name__.rsplit(".", 1)[-1] for item in items}
    items.sort(key=lambda item: rank.get(module[item], len(rank)))  # a stable sort
    for item in items:
        group = "ray" if module[item] in RAY_MODULES else "http" if module[item] in HTTP_MODULES else module[item]
        item.add_marker(pytest.mark.xdist_group(group))


HTTP_ADMIN_TOKEN = "test-admin-token"


@pytest.fixture(scope="session")
def http_server(make_checkpoint):
    """One TP=2 `lockstep serve --http` on the llama seed-3 checkpoint (admin token HTTP_ADMIN_TOKEN), started once
    for the HTTP_MODULES (one xdist group); `.http` is its base URL."""
    from tests.serving import http_serve

    with http_serve(make_checkpoint("llama", seed=3)) as s:
        yield s


def per_request_manager(model):
    """A manager that honours per-request sampling parameters, over a cache of 4 pages of 16 tokens."""
    import cluster

    return model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(
        page_size=16, num_blocks=4, per_request_processors=True))


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def make_checkpoint(model_root):
    """make_checkpoint(arch, seed=0, **overrides) -> directory, made once per session."""

    def get(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in _MODELS:
            name = f"{arch}-seed{seed}" + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
            _MODELS[key] = make_model(model_root / name, arch=arch, size="tiny", seed=seed, **overrides)
        return _MODELS[key]

    return get


@pytest.fixture(scope="session")
def moe_update_sources(make_checkpoint, tmp_path_factory):
    """moe_update_sources(arch) -> the directory of tests/moe_updates.py's sources for that MoE family (made once):
    from its test checkpoint (tests/test_moe.py MOE_CHECKPOINTS) to seed 1's, and part of the way back."""
    from tests.moe_updates import write_sources
    from tests.test_moe import MOE_CHECKPOINTS

    def get(arch: str) -> Path:
        overrides = MOE_CHECKPOINTS[arch]
        return write_sources(make_checkpoint(arch, **overrides), make_checkpoint(arch, seed=1, **overrides),
                             make_checkpoint(arch, seed=1, layout="fused", **overrides),
                             tmp_path_factory.getbasetemp() / f"moe-updates-{arch}")

    return get


_REFERENCE: dict[tuple, list[list[int]]] = {}
# transformers' reference outputs on disk, keyed by everything they depend on: the checkpoint's bytes (config,
# generation config, weights), the prompts, the token count, and the transformers and torch versions. A key that
# is not there is computed (and written); committed entries spare a clean clone the reference generates.
REFERENCES = REPO / "tests" / "references"


def reference_key(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> str:
    import torch
    import transformers

    h = hashlib.sha256()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        h.update((Path(model_dir) / name).read_bytes())
    h.update(json.dumps([prompts, new_tokens, transformers.__version__, torch.__version__]).encode())
    return h.hexdigest()[:40]


def hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' own generate, greedy, float32, on the CPU, one prompt at a time (no padding); cached in
    memory and in tests/references."""
    key = (str(model_dir), tuple(map(tuple, prompts)), new_tokens)
    if key not in _REFERENCE:
        path = REFERENCES / f"{reference_key(model_dir, prompts, new_tokens)}.json"
        if path.exists():
            _REFERENCE[key] = json.loads(path.read_text())
        else:
            _REFERENCE[key] = transformers_greedy(model_dir, prompts, new_tokens)
            REFERENCES.mkdir(exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(_REFERENCE[key]))
            tmp.replace(path)
    return _REFERENCE[key]


def transformers_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
            outs.append(ids[0, len(p):].tolist())
    return outs


def run_ranks(script: str, args: list[str], nproc: int = 2, timeout: float = 300, env: dict | None = None,
              torchrun: bool = False) -> subprocess.CompletedProcess:
    """Run `script` (a path, or a name in tests/scripts) on `nproc` local ranks: started by this process with
    torchrun's environment (tests/local_ranks.py), or through torchrun itself when `torchrun` (what a user runs);
    the whole group is killed on timeout."""
    path = Path(script) if os.path.isabs(script) else REPO / "tests" / "scripts" / script
    full_env = ranks_base_env(env)
    if not torchrun:
        return run_local_ranks(path, args, nproc, timeout, full_env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(path), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{script} timed out after {timeout}s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def read_json(path: Path):
    with open(path) as f:
        return json.load(f)


def lost_peer_error(script: str, mode: str, out: Path, error: str, waited_for: str, env: dict | None = None) -> dict:
    """Run a shared-memory exchange's rank script (tests/scripts) in a failure `mode` at two ranks and check the
    record it writes: the exchange was made, and the wait ended in `error`, a collective error: a dead peer
    ("...dies") seen within 5 s, a silent one past the group's 2 s timeout ("stalls") naming `waited_for`."""
    proc = run_ranks(script, [mode, str(out)], nproc=2, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rec = read_json(out)
    assert rec["made"] and rec["error"] == error and rec["collective"], rec
    if mode == "stalls":
        assert f"did not reach {waited_for}" in rec["message"] and 2 <= rec["waited_s"] < 6, rec
    else:
        assert "process gone" in rec["message"] and rec["waited_s"] < 5, rec
    return rec


def vocab_of(model_dir: Path) -> int:
    """A checkpoint's vocabulary size from its config.json (a multimodal one's text config), without loading it."""
    cfg = read_json(Path(model_dir) / "config.json")
    return cfg["vocab_size"] if "vocab_size" in cfg else cfg["text_config"]["vocab_size"]

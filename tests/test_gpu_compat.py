"""The GPU path, reached from the CPU: every tensor the model code makes follows the parameters' device (the
meta device stands in for a GPU: a tensor made on the CPU by default shows up as 'cpu'), every device thread
sets its CUDA device, pyproject's ranges keep a GPU machine's torch and transformers, transformers'
ContinuousBatchingConfig is built whichever page field it has, and benchmarks/gpu_proof.sh runs end to end
in its CPU dry-run mode as it would on the GPU image: without zmq, fastapi, uvicorn, starlette, ray, openai or
flash_attn (a meta-path finder hides them), with no package registry (every pip call has --no-index), within
its time budget, and with `python3` where there is no `python`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import tomllib
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3Config

from cluster.config import ContinuousBatchingConfig, resolve_config
from cluster.plan import StepPlan
from worker.layers import Shard, VocabParallelEmbedding
from worker.models import build_model
from worker.runner import ModelRunner

REPO = Path(__file__).resolve().parents[1]
META = torch.device("meta")
sys.path.insert(0, str(REPO))  # benchmarks/ is a plain folder of scripts, importable from the repository root

# What the GPU image lacks: a sitecustomize.py (put first on PYTHONPATH) hides these from every import and every
# importlib.util.find_spec, in that process and in every Python process it starts.
HIDDEN = ("zmq", "fastapi", "uvicorn", "starlette", "ray", "openai", "flash_attn")
HIDER = f"""import sys

HIDDEN = {set(HIDDEN)!r}


class Hide:
    \"\"\"Wraps a meta-path finder: the hidden top-level packages (and everything under them) are not found.\"\"\"

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN or not hasattr(self.inner, "find_spec"):
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.inner, name)


sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
"""


def image_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a process that sees only what the GPU image has (HIDDEN hidden)."""
    hider = tmp_path / "hider"
    hider.mkdir(exist_ok=True)
    (hider / "sitecustomize.py").write_text(HIDER)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(hider), str(REPO)])}


def tiny_config() -> Qwen3Config:
    return Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)


def test_every_model_tensor_is_made_on_the_parameters_device():
    model = build_model(tiny_config(), Shard(), torch.float32, META)  # no ambient torch.device(...) around it
    devices = {t.device for t in model.parameters()} | {t.device for t in model.buffers()}
    assert devices == {META}
    rc = resolve_config(ContinuousBatchingConfig(page_size=16, num_blocks=8, max_batch_tokens=64,
                                                 max_requests_per_batch=4), device_kind="cpu", max_model_len=128,
                        kv_bytes_per_token=1, free_bytes=None, flash_available=False)
    runner = ModelRunner(model, rc, 2, 8, torch.float32, META)
    plan = StepPlan(input_ids=np.array([5, 6, 7, 8, 9], np.int32), q_lens=np.array([1, 4], np.int32),
                    kv_lens=np.array([3, 4], np.int32), sample=np.array([1, 1], np.int32),
                    block_tables=np.array([[0, 1], [2, 3]], np.int32))
    logits = runner.execute(plan)  # a mixed decode + prefill step: any CPU-made tensor would meet meta ones
    assert logits.device == META and tuple(logits.shape) == (2, 100)


def test_vocab_padding_rows_are_made_where_the_data_is():
    # vocab 10 over 4 ranks: 3 rows a rank, the last rank owns row 9 and two padding rows
    emb = VocabParallelEmbedding(10, 4, Shard(rank=3, size=4), torch.float32)
    src = torch.ones(10, 4, device=META)  # a pushed bucket on the device
    dst, values = emb.shard_of("", "weight", src)
    assert values.device == META and tuple(values.shape) == (3, 4) == tuple(dst.shape)
    cpu_values = emb.shard_of("", "weight", torch.ones(10, 4))[1]
    assert cpu_values.tolist() == [[1.0] * 4] + [[0.0] * 4] * 2


def test_use_device_sets_cuda_devices_only(monkeypatch):
    from worker.memory import use_device

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d)))
    use_device(None)
    use_device("cpu")
    use_device(torch.device("meta"))
    assert calls == []
    use_device("cuda:1")
    assert calls == [torch.device("cuda", 1)]


def test_load_sets_the_calling_threads_device(make_checkpoint, monkeypatch):
    import launch.load

    seen = []
    monkeypatch.setattr(launch.load, "use_device", lambda d: seen.append((threading.current_thread().name, d)))
    result = {}
    th = threading.Thread(target=lambda: result.update(model=launch.load.load(make_checkpoint("llama"))),
                          name="rank-thread")
    th.start()
    th.join(timeout=120)
    assert not th.is_alive() and "model" in result
    assert seen == [("rank-thread", torch.device("cpu"))]


def dependency_ranges() -> dict[str, object]:
    from packaging.requirements import Requirement

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {(r := Requirement(d)).name: r.specifier for d in deps}


@pytest.mark.parametrize("torch_v,transformers_v", [("2.11.0+cu128", "5.17.0"), ("2.13.0", "5.24.0"),
                                                    ("2.16.1+cu130", "5.40.2")])
def test_pyproject_keeps_what_gpu_machines_ship(torch_v, transformers_v):
    ranges = dependency_ranges()
    assert ranges["torch"].contains(torch_v, prereleases=True), ranges["torch"]
    assert ranges["transformers"].contains(transformers_v, prereleases=True), ranges["transformers"]


def test_pyproject_ranges_start_at_the_supported_versions():
    ranges = dependency_ranges()
    assert not ranges["torch"].contains("2.10.0") and not ranges["transformers"].contains("5.16.0")
    from importlib.metadata import version
    assert ranges["torch"].contains(version("torch"), prereleases=True)
    assert ranges["transformers"].contains(version("transformers"), prereleases=True)


@pytest.mark.slow
def test_pip_would_install_lockstep_alone():
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                        "-e", str(REPO)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("Would install")]
    assert line and line[0].split()[2:] == ["lockstep-serve-0.1.0"], r.stdout[-2000:]


PROOF_RUN = """
import importlib.util, sys, tempfile
for name in {hidden!r}:
    assert importlib.util.find_spec(name) is None, name
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise AssertionError(name + " imported")
import benchmarks.gpu_install, benchmarks.gpu_parity, benchmarks.gpu_summary, benchmarks.hf_compat
import benchmarks.throughput, cluster, launch.cli, launch.load, launch.make_model, launch.make_tokenizer
from benchmarks.gpu_parity import lockstep_run
from launch.cli import main

model = tempfile.mkdtemp() + "/model"
assert main(["make-model", model, "--arch", "llama", "--size", "tiny", "--seed", "0"]) in (0, None)
tokens, logprobs, _ = lockstep_run(model, "cpu", "bfloat16", [[1, 5, 9], [1, 7]], 3, graphs=True, logprobs=True,
                                   burst=2)
assert [len(t) for t in tokens] == [3, 3] and [len(x) for x in logprobs] == [3, 3], (tokens, logprobs)
print("proof path ran without", sorted({hidden!r}))
"""


@pytest.mark.slow
def test_proof_path_runs_without_the_serving_packages(tmp_path):
    """What the proof reaches (its scripts' imports, `launch.cli make-model`, cluster.load and a generate_batch
    with graphs, logprobs and a burst) imports and runs with HIDDEN absent."""
    r = subprocess.run([sys.executable, "-c", PROOF_RUN.format(hidden=HIDDEN)], env=image_env(tmp_path), cwd=tmp_path,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "proof path ran without" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def fake_pip(monkeypatch, gi, returncode: int = 0) -> list[list[str]]:
    """Record gpu_install's pip commands instead of running them."""
    calls: list[list[str]] = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, returncode, "Would install lockstep-serve-0.1.0\n", "ERROR: no")

    monkeypatch.setattr(gi.subprocess, "run", run)
    return calls


def test_install_reaches_no_registry_and_takes_packages_from_wheels_only(tmp_path, monkeypatch):
    import benchmarks.gpu_install as gi

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl", "prometheus_client-0.26.0-py3-none-any.whl"):
        (wheels / name).touch()
    monkeypatch.setattr(gi, "WHEELS", wheels)
    monkeypatch.setattr(gi, "missing", lambda mods: [d for d in mods.values()
                                                     if d in {"msgpack", "pyzmq", "fastapi", "prometheus-client"}])
    calls = fake_pip(monkeypatch, gi)
    report = gi.Report()
    gi.install_lockstep(report, dry=False)
    gi.install_light(report, {"torch": "2.11.0", "transformers": "5.17.0"}, dry=False)
    assert calls and all("--no-index" in c for c in calls), calls
    carried = calls[-1]
    assert carried[carried.index("--find-links") + 1] == str(wheels)
    assert carried[-2:] == ["pyzmq", "prometheus-client"]  # what wheels/ holds, nothing else asked of pip
    assert report.fatal == ["msgpack missing, needed by the proof, and no wheel in wheels/"]
    assert any(x.startswith("fastapi not installed (not needed by the proof") for x in report.done), report.done
    assert gi.has_wheel("prometheus_client", wheels) and not gi.has_wheel("pyzm", wheels)

    failing = fake_pip(monkeypatch, gi, returncode=1)  # a serving wheel that does not install: noted, not fatal
    monkeypatch.setattr(gi, "missing", lambda mods: [d for d in mods.values() if d == "pyzmq"])
    report = gi.Report()
    gi.install_light(report, {}, dry=True)
    assert report.fatal == [] and "--dry-run" in failing[0] and "failed" in report.done[0], report


def test_proof_steps_fit_the_time_budget():
    script = (REPO / "benchmarks" / "gpu_proof.sh").read_text()
    limits = [int(x) for x in re.findall(r"^\s*step \S+ (\d+) ", script, re.M)]
    budget = int(re.search(r"^LIMIT_S=(\d+)", script, re.M).group(1))
    assert len(limits) == 9 and sum(limits) == budget <= 420, (limits, budget)
    assert "--pairs 1 " in script


@pytest.mark.slow
def test_proof_falls_back_to_python3(tmp_path):
    """No `python` on PATH, no PYTHON: the script runs `python3` (here a wrapper that leaves a mark)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mark = tmp_path / "python3-ran"
    wrapper = bin_dir / "python3"
    wrapper.write_text(f"#!/bin/sh\ntouch {mark}\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    path = os.pathsep.join([str(bin_dir)] + [d for d in os.environ["PATH"].split(os.pathsep)
                                             if not (Path(d) / "python").exists()])
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {"PATH": path}
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_proof.sh"), "--out", str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert mark.exists(), r.stdout + r.stderr  # it asked python3 how many GPUs there are
    assert r.returncode == 2 and "no CUDA device visible" in r.stderr  # and there is none here


def test_graphs_are_compared_where_both_runs_saw_the_same_context():
    from benchmarks.gpu_parity import same_context_gap

    same = same_context_gap([[4, 5, 6]], [[-1.0, -2.0, -3.0]], [[4, 5, 6]], [[-1.0, -2.01, -3.0]])
    assert same[1] == 3 and abs(same[0] - 0.01) < 1e-9
    # tokens part at position 1: positions 0 and 1 are compared (greedy's maxima), position 2 is not
    parted = same_context_gap([[4, 5, 6]], [[-1.0, -2.0, -9.0]], [[4, 7, 8]], [[-1.0, -2.03, -3.0]])
    assert parted[1] == 2 and abs(parted[0] - 0.03) < 1e-9


@dataclasses.dataclass
class OldConfig:  # a release that only knows `block_size`
    block_size: int = 256
    num_blocks: int | None = None
    use_cuda_graph: bool | None = None


def test_transformers_config_built_through_the_field_it_has():
    from benchmarks.hf_compat import make_cb_config, page_size_of
    from transformers import ContinuousBatchingConfig as HFConfig

    old = make_cb_config(OldConfig, page_size=16, num_blocks=4, use_cuda_graph=False)
    assert (old.block_size, old.num_blocks, page_size_of(old)) == (16, 4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current class must not be given its deprecated block_size
        new = make_cb_config(HFConfig, page_size=16, use_cuda_graph=True)
    assert page_size_of(new) == new.page_size == 16 and new.use_cuda_graph is True
    with pytest.raises(TypeError, match="max_batch_tokens"):
        make_cb_config(OldConfig, page_size=16, max_batch_tokens=8)


@pytest.mark.slow
def test_summary_fails_on_a_failed_check_or_a_slow_ratio(tmp_path):
    (tmp_path / "steps.tsv").write_text("parity\t0\t10.0\t\nthroughput-tp2\t200\t0\tskipped: one GPU\n")
    for file in ("parity.json", "moe_parity.json", "sinks_parity.json", "mla_parity.json"):
        (tmp_path / file).write_text(json.dumps([{"check": "float32 greedy parity", "result": "ok", "ok": True}]))
    run = [{"engine": "lockstep", "counts": [10] * 10, "wall": 1.0, "notes": []},
           {"engine": "transformers", "counts": [10] * 10, "wall": 1.2}]
    (tmp_path / "tp1.json").write_text(json.dumps({"results": run, "dtype": "bfloat16", "device": "cuda:0",
                                                   "all_exact": True}))
    summary = [sys.executable, str(REPO / "benchmarks" / "gpu_summary.py"), str(tmp_path)]
    slow = subprocess.run(summary, capture_output=True, text=True, timeout=60)
    assert slow.returncode == 1 and "ratio 1.20x" in slow.stdout, slow.stdout + slow.stderr
    assert "skipped: one GPU" in slow.stdout
    assert subprocess.run(summary + ["--dry-run"], capture_output=True, text=True, timeout=60).returncode == 0
    (tmp_path / "parity.json").write_text(json.dumps([{"check": "float32 greedy parity", "result": "1/2",
                                                       "ok": False}]))
    assert subprocess.run(summary + ["--dry-run"], capture_output=True, text=True, timeout=60).returncode == 1


@pytest.mark.slow
def test_gpu_proof_cpu_dry_run(tmp_path):
    """The whole proof, tiny, on the CPU, with what the GPU image lacks hidden from every step. The dry run's
    checkpoints carry no tokenizer (every step feeds token ids) and its runs size their KV cache to their
    requests: the same steps and checks, without BPE training and a 512-page cache zeroed at every run."""
    out = tmp_path / "proof"
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_proof.sh"), "--cpu-dry-run", "--out", str(out)],
                       env=image_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    table = r.stdout.split("gpu_proof summary", 1)[1]
    for check in ("install keeps torch and transformers", "float32 greedy parity vs transformers",
                  "bfloat16 closeness", "CUDA graphs on vs off", "multi-step decode", "throughput TP=1 vs transformers",
                  "MoE float32 greedy parity vs transformers", "MoE CUDA graphs on vs off",
                  "gpt-oss float32 greedy parity vs transformers", "gpt-oss CUDA graphs on vs off",
                  "MLA float32 greedy parity vs transformers", "MLA CUDA graphs on vs off", "total time"):
        line = next((x for x in table.splitlines() if x.startswith(check)), "")
        assert " PASS " in line, (check, table)
    assert "skipped: CPU dry run" in table and "(limit 420 s)" in table
    rows = json.loads((out / "parity.json").read_text())
    assert [r["ok"] for r in rows[:4]] == [True, True, True, True]
    assert rows[2]["tolerance"] >= 0.05 and rows[2]["max_abs_logprob_diff"] <= rows[2]["tolerance"]
    moe = json.loads((out / "moe_parity.json").read_text())  # parity, bfloat16 eager, graphs on = off; no bursts
    assert [r["ok"] for r in moe[:3]] == [True, True, True] and not any("multi-step" in r["check"] for r in moe)
    sinks = json.loads((out / "sinks_parity.json").read_text())  # gpt-oss: the same three checks
    assert [r["ok"] for r in sinks[:3]] == [True, True, True] and sinks[0]["check"].startswith("gpt-oss ")
    mla = json.loads((out / "mla_parity.json").read_text())  # the same three on the latent-attention model
    assert [r["ok"] for r in mla[:3]] == [True, True, True] and mla[0]["check"].startswith("MLA ")

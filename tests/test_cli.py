"""The command line: make-model writes a checkpoint transformers loads; `lockstep run` is the main job."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def lockstep(*args, timeout=240, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=None)


@pytest.mark.parametrize("arch,model_type", [("llama", "llama"), ("qwen3", "qwen3")])
def test_make_model_writes_a_loadable_checkpoint(tmp_path, arch, model_type):
    """The command's own entry point, in this process (the command as a process: test_same_seed_same_weights)."""
    from transformers import AutoModelForCausalLM

    from launch.cli import main

    out = tmp_path / arch
    assert main(["make-model", str(out), "--arch", arch, "--seed", "3", "--set", "num_key_value_heads=1"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type and config["num_key_value_heads"] == 1
    assert (out / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    assert 2_000_000 < n < 5_000_000


@pytest.mark.slow
def test_same_seed_same_weights(tmp_path):
    """`lockstep make-model` as a process, and the same seed again in this process: the same bytes."""
    from launch.make_model import make_model

    assert lockstep("make-model", str(tmp_path / "a"), "--seed", "5").returncode == 0
    make_model(tmp_path / "b", arch="llama", size="tiny", seed=5)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_main_job_runs_tp2(tmp_path):
    proc = lockstep("run", "--model", str(tmp_path / "tiny"), "--num-prompts", "8", "--new-tokens", "8")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tp=2 requests=8 generated=" in proc.stdout
    assert "req_0: prompt" in proc.stdout
    assert "    'Return the number of' -> '" in proc.stdout  # the made tokenizer: text beside the ids
    assert "requests finished: 100%" in proc.stderr and "tokens generated" in proc.stderr  # what the bar counts


def test_free_ports_lie_below_the_ephemeral_range():
    """Ports handed to a process to bind later come from below the kernel's ephemeral range, where no outgoing
    connection can take them meanwhile (parallel test workers start many servers at once)."""
    import socket

    from launch.torchrun import free_port

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports) and len(ports) > 10
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # and it is free

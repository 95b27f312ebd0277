"""Overlapped scheduling (use_async_batching): the same tokens as the serial loop, at TP=1 and TP=2, under mixed
lengths, EOS mid-batch, max_new_tokens, seeded sampling, repetition penalty, streaming and a cancel in flight;
pause, weight reload and stop while steps are in flight; plans that read the previous step's tokens on the
device; the simulated device stream."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import cluster
from cluster.config import ContinuousBatchingConfig, resolve_config
from cluster.outputs import RequestStatus
from driver.engine.engine import Engine
from driver.engine.request import Request
from tests.conftest import hf_greedy, read_json, run_ranks
from tests.scripts.overlap_rank import MAX_NEW
from tests.workloads import mixed_prompts
from worker.stream import InlineStream, ThreadStream


VOCAB = 512  # small, so that the 64-token EOS list ends requests mid-batch often


def resolved(device_kind: str, **fields):
    return resolve_config(ContinuousBatchingConfig(**fields), device_kind=device_kind, max_model_len=1024,
                          kv_bytes_per_token=4096, free_bytes=8 << 30, flash_available=False)


def test_overlap_resolves_on_for_cuda_off_for_cpu_unless_asked():
    assert resolved("cuda").overlap and not resolved("cpu").overlap
    assert resolved("cpu", use_async_batching=True).overlap
    assert not resolved("cuda", use_async_batching=False).overlap
    assert not any("use_async_batching" in n for n in resolved("cpu", use_async_batching=True).notes)


def check_modes(rec: dict, model_dir, vocab: int) -> None:
    serial, overlap = rec["serial"], rec["overlap"]
    assert overlap["tokens"] == serial["tokens"]  # every row kind, token for token
    assert overlap["status"] == serial["status"]
    assert all(s == RequestStatus.FINISHED for s in serial["status"])
    limits = [MAX_NEW[i % len(MAX_NEW)] for i in range(len(serial["tokens"]))]
    lengths = [len(t) for t in serial["tokens"]]
    assert lengths[::2] == limits[::2]  # no EOS list: every one runs to its max_new_tokens
    assert any(n < m for n, m in zip(lengths[1::2], limits[1::2])), \
        "no request ended on EOS before max_new_tokens: the EOS rows test nothing"
    assert overlap["stream"] == serial["stream"]
    assert overlap["stream"][-1][1] == RequestStatus.FINISHED
    assert [n for n, _ in overlap["stream"]] == list(range(1, len(overlap["stream"]) + 1))
    for mode in (serial, overlap):  # one final output; what it got is the greedy prefix
        assert mode["cancel"]["status"] == RequestStatus.CANCELLED and mode["cancel"]["finals"] == 1
        assert 1 <= len(mode["cancel"]["tokens"]) < 200 and mode["free"]
    prompts = mixed_prompts(vocab)
    reference = hf_greedy(model_dir, [prompts[12]] + prompts[13:16] + prompts[:3], new_tokens=12)
    assert overlap["cancel"]["tokens"][:12] == reference[0][:len(overlap["cancel"]["tokens"][:12])]
    assert overlap["after_pause"] == reference[1:4]
    assert overlap["at_stop"] == [t[:10] for t in reference[4:]]


def test_overlap_same_tokens_tp1(make_checkpoint):
    from tests.scripts.overlap_rank import run

    model_dir = make_checkpoint("llama", vocab_size=VOCAB)
    check_modes(run(str(model_dir)), model_dir, VOCAB)


@pytest.mark.slow
def test_overlap_same_tokens_tp2(make_checkpoint, tmp_path):
    model_dir = make_checkpoint("llama", vocab_size=VOCAB)
    proc = run_ranks("overlap_rank.py", [str(model_dir), str(tmp_path / "rec")], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    check_modes(read_json(tmp_path / "rec.rank0"), model_dir, VOCAB)


def run_engine(runner, rc, groups, prompts, limits) -> tuple[list[list[int]], list]:
    """Greedy requests through a bare Engine until it has no work: (their tokens, every STEP plan). Nothing is
    left in flight, pending or allocated at the end."""
    engine = Engine(runner, rc, groups, seed=None)
    plans = []
    launch = runner.launch
    runner.launch = lambda plan: plans.append(plan) or launch(plan)
    reqs = [Request(f"r{i}", p, max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts, limits))]
    for r in reqs:
        engine.scheduler.add(r)
    while engine.has_work():
        engine.step()
    assert engine.in_flight is None and engine.blocks.num_free == rc.num_blocks
    assert all(r.num_pending == 0 and r.status == RequestStatus.FINISHED for r in reqs)
    return [r.generated for r in reqs], plans


def test_next_plan_reads_the_previous_steps_tokens_on_the_device(make_checkpoint):
    """Overlapped, a decode's input id is -(1 + its row among the previous step's samples), resolved from the
    shared tokens; a request at its limit is not scheduled again; the result equals transformers'."""
    model_dir = make_checkpoint("llama")
    model = cluster.load(model_dir)
    runner, rc, groups = model.build_runner(ContinuousBatchingConfig(page_size=16, use_async_batching=True))
    prompts = mixed_prompts(2048)[2:5]
    tokens, plans = run_engine(runner, rc, groups, prompts, [4, 1, 6])
    assert tokens == [t[:n] for t, n in zip(hf_greedy(model_dir, prompts), [4, 1, 6])]
    assert all(p.share_tokens for p in plans)
    assert plans[0].input_ids.min() >= 0  # the prefill: every token on the host
    assert plans[1].input_ids.tolist() == [-1, -3]  # rows 0 and 2 of step 0 (r1 had its one token)
    assert plans[2].input_ids.tolist() == [-1, -2]
    assert len(plans) == 6  # r2 runs for 5 steps after its prefill, its last token is sampled, never run


def test_overlapped_decode_graphs_read_the_shared_tokens(make_checkpoint):
    """Decode steps replayed from (stand-in) graphs resolve the shared tokens into the captured input buffer."""
    from worker.graphs import EagerStandIn
    from worker.self_attention import KVHeads, head_dim_of
    from worker.runner import ModelRunner

    model_dir = make_checkpoint("llama")
    model = cluster.load(model_dir)
    _, rc, groups = model.build_runner(ContinuousBatchingConfig(page_size=16, max_requests_per_batch=4,
                                                                use_async_batching=True))
    runner = ModelRunner(model.model, rc, KVHeads(model.config, model.model.shard).kv_local,
                         head_dim_of(model.config), model.dtype, model.device, graph_factory=EagerStandIn())
    prompts, limits = mixed_prompts(2048)[3:6], [9, 4, 7]
    tokens, plans = run_engine(runner, rc, groups, prompts, limits)
    assert tokens == [t[:n] for t, n in zip(hf_greedy(model_dir, prompts), limits)]
    assert runner.graph_stats["replays"] >= 6 and any(p.input_ids.min() < 0 for p in plans)


def test_streams_run_in_order_and_keep_errors():
    for stream in (InlineStream(torch.device("cpu")), ThreadStream(torch.device("cpu"))):
        seen = []
        first = stream.submit(lambda: (time.sleep(0.01), seen.append(1), 5)[2])
        second = stream.submit(lambda: seen.append(first.in_order()) or 6)
        assert second.result() == 6 and seen == [1, 5] and first.result() == 5
        if isinstance(stream, ThreadStream):
            bad = stream.submit(lambda: 1 // 0)
            with pytest.raises(ZeroDivisionError):
                bad.result()
            assert stream.busy_s >= 0.01
            stream.close()


def test_shared_token_ids_resolve_on_the_device(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    runner, _, _ = model.build_runner(ContinuousBatchingConfig(page_size=16))
    runner.shared_tokens[:3] = torch.tensor([11, 22, 33])
    ids = torch.tensor([5, -1, -3, 0, -2])
    runner._resolve_ids(ids)
    assert ids.tolist() == [5, 11, 33, 0, 22]
    assert np.array_equal(runner.shared_tokens[:3].numpy(), [11, 22, 33])


@pytest.mark.slow
@pytest.mark.parametrize("head", ["device", "gloo"])
def test_control_plane_benchmark_prints_one_line_per_configuration(head):
    """A reduced run of benchmarks/control_plane.py (2 ranks, 8 sequences, a few steps), for its output format,
    with the head's collective inside the step time and over gloo."""
    import re
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "control_plane.py"), "--tp", "2", "--seqs", "8",
                           "--step-ms", "1", "--warmup", "2", "--steps", "5", "--burst", "4", "--head", head],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(rf"^busy=(\d+\.\d) (?:host_ms=\d+\.\d\d )?step_ms=1 seqs=8 tp=2 overlap=(on|off) burst=(\d+) "
                       rf"head={head} device=queue$",
                       proc.stdout, re.M)
    # off, on, and on with multi-step decode (--burst 4): as it goes, and in the summary
    assert sorted((mode, int(k)) for _, mode, k in lines) == [("off", 1)] * 2 + [("on", 1)] * 2 + [("on", 4)] * 2
    assert all(float(busy) > 0 for busy, _, _ in lines)
    bursts = [float(row.split()[7]) for row in proc.stdout.splitlines() if row.split()[:4] == ["2", "8", "1", "on/4"]]
    assert bursts and bursts[0] > 1, "multi-step decode ran one forward a plan"  # the first table's fwd/plan


@pytest.mark.parametrize("queue", [True, False])
def test_simulated_device_keeps_its_own_clock(queue):
    """benchmarks/simulated_device.py: as a CUDA stream, the launching thread does not wait for a step's end
    (queue), or does (sync); either way the host's read of the step's tokens waits for the device clock."""
    from benchmarks.simulated_device import SimulatedForward

    forward = SimulatedForward(tp=1, rank=0, rows=4, queue=queue)
    forward.step_s = 0.2
    t0 = time.perf_counter()
    forward.open()
    forward.pace()  # the step's last op is issued at once
    issued = time.perf_counter() - t0
    assert (issued < 0.1) if queue else (issued >= 0.19)
    assert forward.closed - t0 >= 0.19 and forward.late_s < 0.05
    host, event = forward.events(lambda picks: (picks, None))("tokens")
    assert host == "tokens"
    event.synchronize()
    assert time.perf_counter() - t0 >= 0.19  # the host waited for the step's end
    time.sleep(0.05)
    forward.open()  # the next step is issued after the device went idle: it waited for the host
    assert forward.late_s >= 0.04

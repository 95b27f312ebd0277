"""Greedy outputs token-identical to transformers' generate (float32, CPU), for every architecture and TP size,
under chunked prefill, prefix sharing and preemption, with overlapped scheduling (use_async_batching) off and on,
with multi-step decode (decode_burst) on, and with speculative decoding (docs/speculative.md): n-gram, and the
checkpoint drafting for itself on rank 0 (every proposal it makes is the target's, through its own cache)."""

from __future__ import annotations

import os

import pytest

import cluster
from cluster.outputs import RequestStatus
from tests.conftest import hf_greedy, read_json, run_ranks, transformers_greedy, vocab_of
from tests.workloads import MODE_SCENARIOS, MODES, NEW_TOKENS, SCENARIOS, mode_fields, prompts_for, runs_of

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def check_scenario(name: str, tokens: list[list[int]], status: list[int], stats: dict, reference,
                   mode: str) -> None:
    assert len(tokens) == len(reference)
    for i, (got, want) in enumerate(zip(tokens, reference)):
        assert got == want, f"{name}: prompt {i} differs from transformers: {got[:10]} vs {want[:10]}"
    assert all(s == RequestStatus.FINISHED for s in status)
    if mode == "burst":
        assert stats["burst_forwards"] > 0, "multi-step decode ran no burst: the mode tests nothing"
    if mode == "spec":  # the tiny models' greedy outputs repeat: proposals hit, and some miss
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    if mode == "draft":  # the checkpoint drafts for itself: its greedy proposals are the target's
        assert stats["spec_accepted_tokens"] > 0, stats
    if name == "sharing":
        assert stats["prefix_hit_blocks"] > 0, "the shared-prefix scenario reused no block"
    if name == "preempt":
        assert stats["preemptions"] > 0, "the small-cache scenario preempted nothing"
        assert stats["recomputed_tokens"] > 0, "without a host pool preempted KV is recomputed"
    if name == "offload":  # the same preemptions, but the KV went to the host pool and came back: nothing recomputed
        assert stats["preemptions"] > 0 and stats["swapped_out_requests"] == stats["preemptions"]
        assert stats["swapped_in_requests"] == stats["swapped_out_requests"] and stats["swapped_out_pages"] > 0
        assert stats["recomputed_tokens"] == 0


# The scheduling modes run the same code for every architecture, and the architectures the same modelling code in
# every mode: every architecture runs overlapped (the default), and one of them in series and with multi-step decode.
MODE_ARCH = "llama"
TP1_RUNS = [(arch, mode) for arch in ARCHS for mode in MODES if mode == "overlap" or arch == MODE_ARCH]


@pytest.mark.slow
@pytest.mark.parametrize("arch,mode", TP1_RUNS)
def test_tp1_matches_transformers(arch, mode, make_checkpoint):
    model_dir = make_checkpoint(arch)
    model = cluster.load(model_dir)
    for name, _ in runs_of([mode], SCENARIOS):
        fields, kind = SCENARIOS[name]
        prompts = prompts_for(kind, model.config.vocab_size)
        config = cluster.ContinuousBatchingConfig(**fields, **mode_fields(mode, model_dir))
        out = model.generate_batch(prompts, continuous_batching_config=config, max_new_tokens=NEW_TOKENS)
        assert list(out) == [f"req_{i}" for i in range(len(prompts))]
        check_scenario(name, [o.generated_tokens for o in out.values()], [o.status for o in out.values()],
                       model.last_stats, hf_greedy(model_dir, prompts), mode)


# the generic path (worker/generic/) for the architectures whose config declares a base_model_tp_plan, in two
# scenarios, both of them prefill chunked at 128 tokens (tests/test_generic.py runs them, and Granite, whose
# multipliers are scalars every rank applies alike, at TP=1, in this process): OLMo 2's q/k norms over all heads,
# Phi-3's fused projections and window, Cohere's parallel block
GENERIC_TP2 = {"olmo2": ("olmo2", {}), "phi3-window": ("phi3", {"sliding_window": 48}), "cohere": ("cohere", {})}
GENERIC_SCENARIOS = ("sharing", "preempt")
# Gemma 2 (its scores capped, every other layer windowed at 32) in the generic path's two scenarios
SHORT_TP2 = {"gemma2": ("gemma2", {})}
# Mistral's window is a mask every rank applies alike to its heads: Gemma 3's and Phi-3's windows run at TP=2
TP2_CASES = {a: (a, {}) for a in ARCHS if a != "mistral"} | {"llama-kv1": ("llama", {"num_key_value_heads": 1}),
                                                             "gemma3": ("gemma3", {"sliding_window": 48})}
TP2_CASES |= SHORT_TP2 | GENERIC_TP2
# as at TP=1: every case overlapped, one architecture in the other modes (the plan, its broadcast and multi-step
# decode's token broadcast are the same code for every architecture; tests/test_gemma.py runs Gemma 3 at TP=1), each
# mode in its scenarios (tests/workloads.py MODE_SCENARIOS), but in series: the workers run the same plans either way,
# and the driver's serial step runs at TP=2 under speculation (a speculating row's step is serial)
TP2_MODES = [mode for mode in MODES if mode != "serial"]
TP2_RUNS = [(case, mode) for case in TP2_CASES for mode in TP2_MODES if mode == "overlap" or case == MODE_ARCH]
# the other native cases at TP=2: their sharded layers through prefill chunks and shared pages (each runs every
# scenario at TP=1; preemption and the host pool are the same scheduling and page code for every architecture)
NATIVE_TP2_SCENARIOS = ("chunked", "sharing")


def tp2_scenarios(case: str, mode: str = "overlap") -> tuple[str, ...]:
    if case in GENERIC_TP2 or case in SHORT_TP2:
        return GENERIC_SCENARIOS
    return MODE_SCENARIOS[mode] if case == MODE_ARCH else NATIVE_TP2_SCENARIOS


@pytest.fixture(scope="module")
def tp2_outputs(make_checkpoint, tmp_path_factory):
    """Every TP=2 case in one torchrun launch (tests/scripts/parity_rank.py); each test reads its own files."""
    prefix = tmp_path_factory.mktemp("parity") / "out"
    dirs = {case: make_checkpoint(arch, **overrides) for case, (arch, overrides) in TP2_CASES.items()}
    specs = [f"{case}={d}=" + ",".join(m for c, m in TP2_RUNS if c == case) + "=" + ",".join(tp2_scenarios(case))
             for case, d in dirs.items()]
    proc = run_ranks("parity_rank.py", [str(prefix), *specs], timeout=600)
    return prefix, dirs, proc


@pytest.mark.slow
@pytest.mark.parametrize("case,mode", TP2_RUNS)
def test_tp2_matches_transformers(case, mode, tp2_outputs):
    prefix, dirs, proc = tp2_outputs
    out_path = f"{prefix}.{case}.json"
    assert os.path.exists(out_path), proc.stdout[-4000:]
    results = read_json(out_path)
    rank1 = read_json(out_path + ".rank1")
    model_dir = dirs[case]
    vocab = vocab_of(model_dir)
    for name in tp2_scenarios(case, mode):
        r, kind = results[f"{name}/{mode}"], SCENARIOS[name][1]
        assert r["stats"]["model_impl"] == ("generic" if case in GENERIC_TP2 else "native")
        check_scenario(name, r["tokens"], r["status"], r["stats"], hf_greedy(model_dir, prompts_for(kind, vocab)),
                       mode)
        assert rank1[f"{name}/{mode}"] == r["tokens"], "rank 1 got different results from rank 0"


@pytest.mark.slow
def test_tp2_launch_exits_cleanly(tp2_outputs):
    out = tp2_outputs[2].stdout
    assert tp2_outputs[2].returncode == 0, out[-4000:]
    # both ranks share this host: every checkpoint ran with the shared-memory all-reduce (cluster/host_all_reduce.py)
    assert out.count("host_all_reduce=True") == 2 * len(TP2_CASES) and "host_all_reduce=False" not in out


def test_sliding_window_matches_transformers(make_checkpoint):
    """Mistral with a window shorter than most prompts: keys older than the window are masked, as transformers
    masks them."""
    model_dir = make_checkpoint("mistral", sliding_window=48)
    model = cluster.load(model_dir)
    prompts = prompts_for("mixed", model.config.vocab_size)[::2]
    out = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS,
                               continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16,
                                                                                          max_batch_tokens=64))
    assert [o.generated_tokens for o in out.values()] == hf_greedy(model_dir, prompts)


@pytest.mark.slow
def test_cached_references_are_transformers_own(make_checkpoint):
    """tests/references only spares the work: a few prompts generated afresh equal the cached answers."""
    model_dir = make_checkpoint("qwen3")
    prompts = prompts_for("mixed", vocab_of(model_dir))
    picked = [0, 7, 15]
    assert transformers_greedy(model_dir, [prompts[i] for i in picked], NEW_TOKENS) == \
        [hf_greedy(model_dir, prompts)[i] for i in picked]

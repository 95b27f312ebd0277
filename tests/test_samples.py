"""n samples of one prompt (num_return_sequences; driver/engine/fork.py) at TP=2 with real processes: the samples
are transformers' continuous batching's (ids, order, greedy tokens), the prompt is prefilled once for the group,
a child samples what an independent request of its id samples, and preemption and cancels free every page."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig

from cluster.outputs import RequestStatus
from tests.conftest import hf_greedy, read_json, run_ranks
from tests.scripts.samples_rank import GROUP, N_SAMPLES, NEW_TOKENS, PAGE, greedy_config, prompts


@pytest.fixture(scope="module")
def record(make_checkpoint, tmp_path_factory):
    model_dir = make_checkpoint("llama")
    out = tmp_path_factory.mktemp("samples") / "rec"
    proc = run_ranks("samples_rank.py", [str(model_dir), str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return model_dir, [read_json(f"{out}.rank{r}") for r in (0, 1)]


def vocab(model_dir) -> int:
    return read_json(model_dir / "config.json")["vocab_size"]


def transformers_batch(model_dir) -> dict[str, list[int]]:
    """transformers' own continuous batching, same prompts, generation config and pages (float32, CPU)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate_batch(prompts(vocab(model_dir)), generation_config=greedy_config(),
                               continuous_batching_config=ContinuousBatchingConfig(page_size=PAGE, max_batch_tokens=64))
    return {k: v.generated_tokens for k, v in out.items()}


def check_greedy(got: dict, model_dir, hf: dict[str, list[int]] | None, mode: str) -> None:
    """One rank's greedy n-samples batch: transformers' continuous batching's ids, order and tokens (when `hf` is
    given), each sample transformers' greedy tokens, one prefill a group, the partly filled page copied, every page
    free at the end."""
    ps = prompts(vocab(model_dir))
    if hf is not None:
        assert got["ids"] == list(hf), mode  # children first, then the parent, as transformers orders them
        assert got["tokens"] == list(hf.values()), mode
    assert len(got["ids"]) == len(set(got["ids"])) == len(ps) * N_SAMPLES, mode
    want = hf_greedy(model_dir, ps, NEW_TOKENS)
    for rid, tokens in zip(got["ids"], got["tokens"]):  # parent and children alike; "req_3__child#1" is prompt 3's
        assert tokens == want[int(rid.split("__")[0].split("_")[1])], (mode, rid)
    stats = got["stats"]
    # one prefill a group: the prompt once, and each child's last prompt token (its first decode)
    assert stats["prompt_tokens_computed"] == sum(len(p) + N_SAMPLES - 1 for p in ps), mode
    assert stats["forked_children"] == len(ps) * (N_SAMPLES - 1)
    assert stats["fork_shared_pages"] == sum((len(p) - 1) // PAGE for p in ps) * (N_SAMPLES - 1)
    assert stats["fork_copied_pages"] == sum((len(p) - 1) % PAGE != 0 for p in ps) * (N_SAMPLES - 1)
    assert stats["free_blocks"] == stats["num_blocks"]


@pytest.mark.slow
def test_greedy_samples_match_transformers_continuous_batching(record):
    model_dir, (rank0, rank1) = record
    hf = transformers_batch(model_dir)
    for mode in ("greedy", "greedy_overlap"):
        check_greedy(rank0[mode], model_dir, hf, mode)
        assert rank1[mode]["ids"] == rank0[mode]["ids"] and rank1[mode]["tokens"] == rank0[mode]["tokens"]


def test_greedy_samples_in_process_tp1(make_checkpoint):
    """The fork's logic in this process at TP=1 (the fast tier's test): serial and overlapped with bursts, on a MoE
    checkpoint (GLM-4.5's router, shared experts; the TP=2 tests run Llama), so it also checks n samples on MoE."""
    import cluster
    from tests.scripts.samples_rank import batch

    model_dir = make_checkpoint("glm4_moe")
    model = cluster.load(model_dir)  # transformers' own ids and order: the TP=2 test above
    check_greedy(batch(model, greedy_config()), model_dir, None, "greedy")
    check_greedy(batch(model, greedy_config(), use_async_batching=True, decode_burst=4), model_dir, None, "overlap")


@pytest.mark.slow
def test_seeded_children_draw_what_independent_requests_of_their_ids_draw(record):
    model_dir, (rank0, rank1) = record
    seeded = dict(zip(rank0["seeded"]["ids"], rank0["seeded"]["tokens"]))
    assert rank1["seeded"]["tokens"] == rank0["seeded"]["tokens"]
    children = {k: v for k, v in seeded.items() if "__child#" in k}
    assert len(children) == len(prompts(vocab(model_dir))) * (N_SAMPLES - 1)
    assert rank0["independent"] == children  # the fork is invisible: the same KV, the same noise key
    for k in (k for k in seeded if "__child#" not in k):  # the n samples of a prompt differ from each other
        group = [v for i, v in seeded.items() if i.split("__")[0] == k]
        assert len({tuple(v) for v in group}) == N_SAMPLES, group


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pressure", "pressure_offload"])
def test_preempted_and_cancelled_samples_free_their_pages(record, mode):
    model_dir, (rank0, rank1) = record
    rec = rank0[mode]
    expected = hf_greedy(model_dir, [prompts(vocab(model_dir))[0]], 20)[0]
    outs = rec["outputs"]
    assert len(outs) == GROUP + 3 and rank1[mode]["outputs"] == outs
    assert outs["h"][0] == RequestStatus.CANCELLED and outs["h"][1] == []
    for rid, (status, tokens, reason) in outs.items():
        if rid == "h":
            continue
        if status == RequestStatus.CANCELLED:  # the child cancelled after its first token
            assert rid == "g__child#2" and tokens == expected[:len(tokens)] and len(tokens) >= 1
        else:
            assert (status, reason, tokens) == (RequestStatus.FINISHED, "length", expected), rid
    stats = rec["stats"]
    assert stats["preemptions"] > 0 and stats["fork_fallbacks"] >= 2  # h's two children went on alone
    assert stats["free_blocks"] == stats["num_blocks"] == 9
    if mode == "pressure_offload":
        assert stats["swapped_out_requests"] > 0

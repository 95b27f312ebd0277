"""The Triton paged attention kernel (worker/triton_attention.py), run on CPU tensors through Triton's interpreter,
against a float64 reference: GQA and MHA, sliding windows, 1/7/16/17/40-key rows at 16-token pages on shuffled
pages, padding rows, prefill chunks continuing an earlier context, float32 and bfloat16, a head_dim that is not a
power of two; then `prepare_step` + `paged_attention` on the Triton path against the paged SDPA path, for a mixed
step and a decode burst advanced as the runner advances it. Every slot that holds no key of the row reading it is
NaN, so a kernel that loads past a row's length (even masked away afterwards) fails. The score terms (per-head
sinks, gpt-oss's; a score softcap, Gemma 2's) alone and together, in both kernels and through both paths.

Triton reads TRITON_INTERPRET when it is imported (its own `tl.zeros`, `tl.max` ... are `triton.jit` functions),
and another test of this process may have imported it already (inductor does), so the kernels run in ONE child
process started with TRITON_INTERPRET=1 (this module as a script, `jobs` in and results out through torch.save);
the references and comparisons run here."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from cluster.config import ContinuousBatchingConfig, resolve_config
from cluster.plan import StepPlan
from worker.flash import varlen_metadata
from tests.triton_interpreter import run_interpreted

PAGE = 16
LENS = [1, 7, 16, 17, 40]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
CASES = [  # (dtype, query heads, KV heads, head_dim, window)
    (torch.float32, 4, 2, 16, None),
    (torch.float32, 2, 2, 16, 8),
    (torch.float32, 6, 2, 24, 5),  # three query heads a KV head, head_dim padded to 32
    (torch.bfloat16, 4, 2, 32, None),
    (torch.bfloat16, 4, 1, 16, 20),
]
# (case, sinks, softcap): CASES' shapes with a sink a query head (drawn around 1), a softcap, or both
TERM_CASES = [(CASES[0], True, None), (CASES[2], True, 2.0), (CASES[1], False, 1.5), (CASES[4], True, 3.0)]
PRE_KV, PRE_Q, PRE_PAD = [40, 17, 16, 7, 33], [40, 5, 1, 7, 20], 11  # fresh prompts and continued chunks


def paged_cache(lens: list[int], hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    """(k, v, tables, scratch block): each row's keys on shuffled pages of a cache of 2 spare pages, every slot
    past a row's keys NaN; tables one page wider than the longest row, padded with the scratch block (zeros)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in lens]
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lens), max(pages) + 1), num_blocks, dtype=torch.int32)  # scratch: block num_blocks
    shape = ((num_blocks + 1) * PAGE, hkv, d)
    k = torch.full(shape, float("nan"), dtype=torch.float64)
    v = k.clone()
    k[num_blocks * PAGE:] = v[num_blocks * PAGE:] = 0.0
    for row, n in enumerate(lens):
        for i in range(pages[row]):
            block = order.pop()
            tables[row, i] = block
            keys, at = min(PAGE, n - i * PAGE), block * PAGE
            k[at:at + keys] = torch.randn(keys, hkv, d, generator=gen, dtype=torch.float64)
            v[at:at + keys] = torch.randn(keys, hkv, d, generator=gen, dtype=torch.float64)
    return k.to(dtype), v.to(dtype), tables, num_blocks


def reference(q, k, v, table, kv_len: int, window: int | None, scale: float, sinks: torch.Tensor | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """One sequence's q [Q, Hq, D] (its last Q positions) against its first kv_len keys, in float64, as
    transformers' eager attention computes it: scale, cap, mask, each head's sink a column of the softmax."""
    nq, hq = q.shape[0], q.shape[1]
    slots = (table.long()[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:kv_len]
    g = hq // k.shape[1]
    keys, values = k[slots].double().repeat_interleave(g, 1), v[slots].double().repeat_interleave(g, 1)
    pos = torch.arange(nq)[:, None] + kv_len - nq
    j = torch.arange(kv_len)[None, :]
    visible = (j <= pos) & ((pos - j < window) if window else True)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(hq, nq, 1)], dim=-1)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1)[..., :kv_len], values)


def term_args(case: tuple, sinks: bool, softcap: float | None) -> dict:
    """The kernels' keyword arguments of a TERM_CASES entry: sinks [Hq] float32, the softcap."""
    hq = case[1]
    drawn = torch.randn(hq, generator=torch.Generator().manual_seed(5)) + 1.0
    return {"sinks": drawn if sinks else None, "softcap": softcap}


def decode_inputs(dtype, hq, hkv, d, window):
    """`decode`'s arguments: the LENS rows, then two padding rows (no key; the scratch block's one key)."""
    k, v, tables, scratch = paged_cache(LENS, hkv, d, dtype)
    tables = torch.cat([tables, torch.full((2, tables.shape[1]), scratch, dtype=torch.int32)])
    lens = torch.tensor(LENS + [0, 1], dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    return q, k, v, tables, lens, PAGE, window, d ** -0.5


def prefill_inputs(dtype, hq, hkv, d, window):
    """`prefill`'s arguments: PRE_Q queries of sequences of PRE_KV keys back to back, then PRE_PAD padding tokens."""
    k, v, tables, scratch = paged_cache(PRE_KV, hkv, d, dtype, seed=2)
    host = varlen_metadata(np.array(PRE_Q), np.array(PRE_KV), tables.numpy(), tables.shape[1] + 1, scratch)
    meta = dataclasses.replace(host, **{f: torch.from_numpy(getattr(host, f))
                                        for f in ("cu_seqlens_q", "cu_seqlens_k", "block_table")})
    q = torch.randn(sum(PRE_Q) + PRE_PAD, hq, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    return q, k, v, meta, PAGE, window, d ** -0.5


# ---------------------------------------------------------------- the Triton path through prepare_step
HQ, HKV, D = 4, 2, 16
MIXED = StepPlan(input_ids=np.arange(3 + 20 + 9, dtype=np.int32), q_lens=np.array([1, 1, 1, 20, 9], np.int32),
                 kv_lens=np.array([9, 17, 40, 20, 33], np.int32), sample=np.ones(5, np.int32),
                 block_tables=np.array([[5, 0, 0], [7, 2, 0], [1, 3, 9], [4, 6, 0], [8, 11, 10]], np.int32))
BURST = StepPlan(input_ids=np.array([3, 4, 5], np.int32), q_lens=np.ones(3, np.int32),  # two cross into a page
                 kv_lens=np.array([15, 7, 31], np.int32), sample=np.ones(3, np.int32),
                 block_tables=np.array([[2, 6, 9], [0, 1, 10], [3, 5, 7]], np.int32), burst=3)


def rcs(**fields):
    """(Triton path, paged SDPA path) configs of one CPU resolution: page 16, 64 pages, 8 a request."""
    def one(path):
        rc = resolve_config(ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_requests_per_batch=8,
                                                     max_blocks_per_request=8, **fields),
                            device_kind="cpu", max_model_len=128, kv_bytes_per_token=64, free_bytes=None,
                            flash_available=False)
        rc.attention = path
        return rc
    return one("triton_paged"), one("paged_sdpa")


def run_paths(plan: StepPlan, window: int | None = None, sinks: torch.Tensor | None = None,
              softcap: float | None = None) -> dict[str, torch.Tensor]:
    """Each path's attention output [forwards, real tokens, Hq, D] for `plan` (`plan.burst` forwards, advanced by
    the runner's own `_advance`), each writing its K/V into its copy of one cache whose unwritten slots are NaN."""
    from worker.attention import ScoreTerms, paged_attention, write_kv
    from worker.runner import ModelRunner
    from worker.step_inputs import StaticBuffers, prepare_step

    gen = torch.Generator().manual_seed(4)
    cache = torch.full((65 * PAGE, HKV, D), float("nan"))
    cache[64 * PAGE:] = 0.0  # the scratch block
    for row, kv in enumerate(plan.kv_lens - plan.q_lens):  # the context before this step
        for j in range(kv):
            cache[plan.block_tables[row, j // PAGE] * PAGE + j % PAGE] = torch.randn(HKV, D, generator=gen)
    tokens = [torch.randn(64, HQ + 2 * HKV, D, generator=gen) for _ in range(plan.burst)]
    outs = {}
    for rc in rcs(use_async_batching=True, decode_burst=plan.burst):
        k, v = cache.clone(), cache * 0.5
        ids, meta, _ = prepare_step(rc, StaticBuffers(rc, torch.device("cpu")), plan, scratch_block=64)
        assert meta.attention == rc.attention
        runner = types.SimpleNamespace(shared_tokens=torch.zeros(8, dtype=torch.int64))
        real = meta.slot_mapping != 64 * PAGE
        got = []
        for step in range(plan.burst):
            if step:
                ModelRunner._advance(runner, ids, meta, plan.num_decode)
            qkv = tokens[step][:ids.shape[0]]
            write_kv(k, v, qkv[:, HQ:HQ + HKV].contiguous(), qkv[:, HQ + HKV:].contiguous(), meta)
            got.append(paged_attention(qkv[:, :HQ].contiguous(), k, v, meta, window, D ** -0.5,
                                       terms=ScoreTerms(sinks, softcap))[real])
        outs[rc.attention] = torch.stack(got)
    return outs


def run_latent_paths(plan: StepPlan) -> dict[str, torch.Tensor]:
    """The MLA layer (worker/latent_attention.py: 4 heads, latent 24 + rope 8 in one cached row, absorbed weights)
    on each path for `plan`: [real tokens, hidden] outputs, each path writing its latent rows into its copy of one
    cache (unwritten slots NaN) and reading them as keys and as values through the block tables."""
    from worker.latent_attention import LatentAttention
    from worker.layers import Shard
    from worker.rope import RotaryTable
    from worker.step_inputs import StaticBuffers, prepare_step

    config = types.SimpleNamespace(num_attention_heads=4, hidden_size=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                   v_head_dim=12, kv_lora_rank=24, q_lora_rank=20, rope_interleave=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                   max_position_embeddings=128, num_hidden_layers=1)
    gen = torch.Generator().manual_seed(5)
    layer = LatentAttention(config, Shard(), torch.float32)
    for param in layer.parameters():
        param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    rope = RotaryTable(config, 8, 128, torch.device("cpu"))
    cache = torch.full((65 * PAGE, 1, 32), float("nan"))
    cache[64 * PAGE:] = 0.0
    for row, kv in enumerate(plan.kv_lens - plan.q_lens):
        for j in range(kv):
            cache[plan.block_tables[row, j // PAGE] * PAGE + j % PAGE] = torch.randn(1, 32, generator=gen)
    x = torch.randn(64, 32, generator=gen)
    outs = {}
    for rc in rcs():
        ids, meta, _ = prepare_step(rc, StaticBuffers(rc, torch.device("cpu")), plan, scratch_block=64)
        k = cache.clone()
        real = meta.slot_mapping != 64 * PAGE
        out = layer(x[:ids.shape[0]], meta, rope.at(meta.positions, torch.float32), {}, k, k)
        outs[rc.attention] = out[real]
    return outs



def jobs() -> dict[str, tuple[str, tuple, dict]]:
    """Every kernel run of this module: name -> (what, its arguments, its keyword arguments)."""
    found = {f"decode{i}": ("decode", decode_inputs(*case), {}) for i, case in enumerate(CASES)}
    found |= {f"prefill{i}": ("prefill", prefill_inputs(*case), {}) for i, case in enumerate(CASES)}
    for i, (case, sinks, softcap) in enumerate(TERM_CASES):
        found[f"decode_terms{i}"] = ("decode", decode_inputs(*case), term_args(case, sinks, softcap))
        found[f"prefill_terms{i}"] = ("prefill", prefill_inputs(*case), term_args(case, sinks, softcap))
    terms = term_args((None, HQ), True, 2.0)
    return found | {"mixed": ("paths", (MIXED,), {}), "mixed_window": ("paths", (MIXED, 6), {}),
                    "burst": ("paths", (BURST,), {}), "mixed_terms": ("paths", (MIXED, 6), terms),
                    "burst_terms": ("paths", (BURST,), terms),
                    "latent": ("latent", (MIXED,), {})}


def run_jobs(folder: str) -> None:
    """The child's side: TRITON_INTERPRET=1 is set before anything imports triton."""
    assert os.environ.get("TRITON_INTERPRET") == "1" and "triton" not in sys.modules
    from worker import triton_attention as kernels

    assert kernels.INTERPRETED
    todo = torch.load(Path(folder) / "jobs.pt", weights_only=False)
    run = {"decode": kernels.decode, "prefill": kernels.prefill, "paths": run_paths, "latent": run_latent_paths}
    torch.save({name: run[what](*args, **kw) for name, (what, args, kw) in todo.items()}, Path(folder) / "out.pt")


@pytest.fixture(scope="module")
def results() -> dict[str, object]:
    """Every job's output, from one interpreter process (a few seconds)."""
    with tempfile.TemporaryDirectory() as folder:
        torch.save(jobs(), Path(folder) / "jobs.pt")
        return run_interpreted("tests.test_triton_attention", Path(folder))  # type: ignore[return-value]


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c[0]}-hq{c[1]}-hkv{c[2]}-d{c[3]}-w{c[4]}" for c in CASES])
def test_decode_matches_reference(results, i):
    """One query a row at each row's own length; padding rows (no key; the scratch block's one key) write zeros
    or finite values and read nothing else."""
    q, k, v, tables, lens, _, window, scale = decode_inputs(*CASES[i])
    out = results[f"decode{i}"]
    assert out.shape == q.shape and out.dtype == q.dtype
    tol = TOL[q.dtype]
    for row, n in enumerate(LENS):
        want = reference(q[row:row + 1], k, v, tables[row], n, window, scale)[0]
        torch.testing.assert_close(out[row].double(), want, rtol=tol, atol=tol)
    assert out[len(LENS)].eq(0).all() and out[len(LENS) + 1].isfinite().all()


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CASES)),
                         ids=[f"{c[0]}-hq{c[1]}-hkv{c[2]}-d{c[3]}-w{c[4]}" for c in CASES])
def test_prefill_matches_reference(results, i):
    """Fresh prompts (q_len == kv_len), chunks continuing an earlier context (q_len < kv_len), a one-query row,
    40 queries (several row blocks); the padding tokens after them get zeros."""
    q, k, v, meta, _, window, scale = prefill_inputs(*CASES[i])
    out = results[f"prefill{i}"]
    assert out.shape == q.shape and out.dtype == q.dtype
    cu, tol = meta.cu_seqlens_q.tolist(), TOL[q.dtype]
    for s, n in enumerate(PRE_KV):
        want = reference(q[cu[s]:cu[s + 1]], k, v, meta.block_table[s], n, window, scale)
        torch.testing.assert_close(out[cu[s]:cu[s + 1]].double(), want, rtol=tol, atol=tol)
    assert out[sum(PRE_Q):].eq(0).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixed", "mixed_window", "burst"])
def test_triton_path_matches_sdpa_path(results, name):
    """prepare_step + paged_attention: a mixed step (three decode rows padded to four, a fresh prompt and a chunk
    continuing its context), with and without a window; a decode burst of three forwards, kv lens and slots
    advanced on the device, two rows crossing into a new page, the later positions NaN until written."""
    outs = results[name]
    assert outs["triton_paged"].isfinite().all()
    assert outs["triton_paged"].shape[0] == (3 if name == "burst" else 1)
    torch.testing.assert_close(outs["triton_paged"], outs["paged_sdpa"], rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(TERM_CASES)), ids=[f"{c[0]}-hq{c[1]}-w{c[4]}-sinks{s}-cap{cap}"
                                                           for c, s, cap in TERM_CASES])
def test_score_terms_match_reference(results, i):
    """Sinks (a head's logit in every row's denominator: the weights of the keys sum to less than one, a row with
    no key writes zeros) and the softcap, in decode and prefill, against transformers' eager arithmetic."""
    case, sinks, softcap = TERM_CASES[i]
    terms = term_args(case, sinks, softcap)
    q, k, v, tables, lens, _, window, scale = decode_inputs(*case)
    out, tol = results[f"decode_terms{i}"], TOL[q.dtype]
    for row, n in enumerate(LENS):
        want = reference(q[row:row + 1], k, v, tables[row], n, window, scale, **terms)[0]
        torch.testing.assert_close(out[row].double(), want, rtol=tol, atol=tol)
    assert out[len(LENS)].eq(0).all() and out[len(LENS) + 1].isfinite().all()
    q, k, v, meta, _, window, scale = prefill_inputs(*case)
    out, cu = results[f"prefill_terms{i}"], meta.cu_seqlens_q.tolist()
    for s, n in enumerate(PRE_KV):
        want = reference(q[cu[s]:cu[s + 1]], k, v, meta.block_table[s], n, window, scale, **terms)
        torch.testing.assert_close(out[cu[s]:cu[s + 1]].double(), want, rtol=tol, atol=tol)
    assert out[sum(PRE_Q):].eq(0).all()
    for dropped in ("sinks", "softcap"):  # each term counts: without it the outputs differ
        if terms[dropped] is not None:
            plain = reference(q[:cu[1]], k, v, meta.block_table[0], PRE_KV[0], window, scale,
                              **(terms | {dropped: None}))
            assert (out[:cu[1]].double() - plain).abs().max() > 10 * tol, dropped


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixed_terms", "burst_terms"])
def test_triton_path_matches_sdpa_path_with_score_terms(results, name):
    """As above, with sinks and a softcap: the paged SDPA path's explicit softmax (worker/attention.py) and the
    Triton kernel agree through prepare_step and paged_attention."""
    outs = results[name]
    assert outs["triton_paged"].isfinite().all()
    torch.testing.assert_close(outs["triton_paged"], outs["paged_sdpa"], rtol=2e-5, atol=2e-5)
    plain = results[name.removesuffix("_terms").replace("mixed", "mixed_window")]
    assert (outs["paged_sdpa"] - plain["paged_sdpa"]).abs().max() > 1e-3  # the terms change the outputs


@pytest.mark.slow
def test_latent_attention_on_the_triton_path_matches_sdpa(results):
    """MLA over its latent rows as one KV head of width kv_lora_rank + qk_rope_head_dim (keys and values the same
    cache tensor, the output's rope columns dropped), through the Triton kernel and through the paged SDPA path, for
    a mixed step (three decode rows padded to four, a fresh prompt, a chunk continuing its context): the same
    layer outputs. worker/flash.py takes the same arguments as the Triton kernel (docs/models.md)."""
    outs = results["latent"]
    assert outs["triton_paged"].isfinite().all() and outs["triton_paged"].shape == (3 + 20 + 9, 32)
    torch.testing.assert_close(outs["triton_paged"], outs["paged_sdpa"], rtol=2e-5, atol=2e-5)


def test_paged_kernels_need_no_gather_workspace():
    from worker.attention import attention_workspace_bytes

    triton_rc, sdpa_rc = rcs()
    paged = attention_workspace_bytes(triton_rc, HQ, HKV, D, torch.float32)
    assert paged == 2 * (triton_rc.max_tokens_padded + 1) * HQ * D * 4  # the outputs alone
    assert paged < attention_workspace_bytes(sdpa_rc, HQ, HKV, D, torch.float32)


if __name__ == "__main__":
    run_jobs(sys.argv[1])

"""Step inputs (worker/step_inputs.py): one host-to-device copy a step, fixed addresses for fixed shapes,
alternating staging buffers, and no [B, L] work under the paged kernels (flash-attn, Triton)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cluster.config import ContinuousBatchingConfig, resolve_config
from cluster.plan import StepPlan
from worker.step_inputs import StaticBuffers, capacity_entries, prepare_step

PAGE = 256


def rc_for(flash: bool, max_requests: int = 512, max_model_len: int = 2048):
    rc = resolve_config(ContinuousBatchingConfig(page_size=PAGE, num_blocks=4096, max_batch_tokens=2048,
                                                 max_requests_per_batch=max_requests),
                        device_kind="cpu", max_model_len=max_model_len, kv_bytes_per_token=1024,
                        free_bytes=None, flash_available=False)
    rc.attention = "flash_attn" if flash else "paged_sdpa"
    return rc


def decode_plan(n: int, context: int, width: int) -> StepPlan:
    rng = np.random.default_rng(0)
    kv = rng.integers(context // 2, context + 1, n).astype(np.int32)
    tables = np.arange(n * width, dtype=np.int32).reshape(n, width)
    return StepPlan(input_ids=rng.integers(3, 1000, n).astype(np.int32), q_lens=np.ones(n, np.int32),
                    kv_lens=kv, sample=np.ones(n, np.int32), block_tables=tables)


def mixed_plan() -> StepPlan:
    return StepPlan(input_ids=np.arange(5, 27, dtype=np.int32), q_lens=np.array([1, 1, 20], np.int32),
                    kv_lens=np.array([9, 40, 20], np.int32), sample=np.array([1, 1, 1], np.int32),
                    block_tables=np.array([[0, 1], [2, 3], [4, 5]], np.int32))


class CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            self.copies += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_one_copy_a_step(flash, kind):
    rc = rc_for(flash, max_requests=16)
    buf = StaticBuffers(rc, torch.device("cpu"))
    plan = decode_plan(5, 300, 2) if kind == "decode" else mixed_plan()
    with CountCopies() as counter:
        ids, meta, n = prepare_step(rc, buf, plan, scratch_block=4096)
    assert counter.copies == 1
    # and the copy carried the host layout: the real tokens, their positions, the scratch slot for padding
    assert ids[:plan.num_decode].tolist() == plan.input_ids[:plan.num_decode].tolist()
    assert meta.positions[:plan.num_decode].tolist() == (plan.kv_lens[:plan.num_decode] - 1).tolist()
    assert n == plan.num_seqs


def test_same_shapes_same_addresses_and_staging_alternates():
    rc = rc_for(False, max_requests=16)
    buf = StaticBuffers(rc, torch.device("cpu"))
    first = prepare_step(rc, buf, decode_plan(4, 100, 1), scratch_block=4096)
    turn = buf.turn
    prepare_step(rc, buf, mixed_plan(), scratch_block=4096)  # other shapes in between
    assert buf.turn != turn  # laid out in the other staging buffer
    again = prepare_step(rc, buf, decode_plan(4, 90, 1), scratch_block=4096)
    ptr = lambda out: [out[0].data_ptr(), out[1].positions.data_ptr(), out[1].dec_kv_slots.data_ptr(),  # noqa: E731
                       out[1].slot_mapping.data_ptr(), out[1].logits_idx.data_ptr()]
    assert ptr(first) == ptr(again)
    assert buf.flat.data_ptr() == buf.buffers["flat"].data_ptr()


def test_flash_builds_nothing_context_wide():
    """Under flash-attn a 512-sequence decode at 2k context lays out no [B, L] list, and the buffer is sized
    without them."""
    rc = rc_for(True)
    assert capacity_entries(rc) < capacity_entries(rc_for(False)) // 10
    buf = StaticBuffers(rc, torch.device("cpu"))
    plan = decode_plan(512, 2048, rc.max_blocks_per_request)
    ids, meta, n = prepare_step(rc, buf, plan, scratch_block=4096)
    assert meta.dec_kv_slots.shape == (512, 0) and meta.pre_kv_slots.numel() == 0
    assert meta.num_decode == 512 and n == 512
    assert meta.dec_block_table.shape == (512, rc.max_blocks_per_request)
    assert meta.dec_block_table.dtype == torch.int32
    assert meta.dec_block_table[7].tolist() == plan.block_tables[7].tolist()
    assert meta.dec_kv_lens.tolist() == plan.kv_lens.tolist()
    # fast: a few hundred microseconds, far from the [B, L] path's cost (generous bound for a loaded machine)
    t0 = time.perf_counter()
    for _ in range(20):
        prepare_step(rc, buf, plan, scratch_block=4096)
    assert (time.perf_counter() - t0) / 20 < 0.01


def test_triton_takes_the_flash_layout():
    """The Triton kernel reads flash-attn's layout: the same buffer size, block tables, kv lens and varlen
    metadata, and the step says whose kernels read them."""
    flash_rc, triton_rc = rc_for(True, max_requests=16), rc_for(True, max_requests=16)
    triton_rc.attention = "triton_paged"
    assert triton_rc.paged_kernels and capacity_entries(triton_rc) == capacity_entries(flash_rc)
    laid = {}
    for rc in (flash_rc, triton_rc):
        _, meta, _ = prepare_step(rc, StaticBuffers(rc, torch.device("cpu")), mixed_plan(), scratch_block=4096)
        assert meta.attention == rc.attention and meta.dec_kv_slots.numel() == meta.pre_q_gather.numel() == 0
        laid[rc.attention] = [t.tolist() for t in (meta.dec_block_table, meta.dec_kv_lens, meta.slot_mapping,
                                                   meta.pre_flash.cu_seqlens_q, meta.pre_flash.block_table)]
    assert laid["triton_paged"] == laid["flash_attn"]


def test_a_step_larger_than_the_buffer_is_refused():
    rc = rc_for(False, max_requests=4)
    buf = StaticBuffers(rc, torch.device("cpu"))
    buf.begin()
    with pytest.raises(RuntimeError, match="static buffer"):
        buf.alloc((capacity_entries(rc) + 1,))


def test_rope_and_masks_are_computed_once_a_step(make_checkpoint, monkeypatch):
    """The rope table is gathered once a step and the decode masks made once a step, not once a layer;
    the rotation equals the rotate-half formula."""
    import cluster
    from worker.models import decoder as model_module
    from transformers.models.llama.modeling_llama import rotate_half

    from worker.rope import RotaryTable

    model = cluster.load(make_checkpoint("mistral"))  # sliding-window layers: a mask per window size
    runner, _, _ = model.build_runner(ContinuousBatchingConfig(page_size=16, num_blocks=64))
    calls = {"at": 0, "masks": 0}
    at, masks = RotaryTable.at, model_module.step_masks

    def counted_at(self, *a):
        calls["at"] += 1
        return at(self, *a)

    def counted_masks(*a):
        calls["masks"] += 1
        return masks(*a)

    monkeypatch.setattr(RotaryTable, "at", counted_at)
    monkeypatch.setattr(model_module, "step_masks", counted_masks)
    plan = StepPlan(input_ids=np.arange(5, 27, dtype=np.int32), q_lens=np.array([1, 1, 20], np.int32),
                    kv_lens=np.array([9, 40, 20], np.int32), sample=np.array([1, 1, 1], np.int32),
                    block_tables=np.array([[0, 1, 2], [3, 4, 5], [6, 7, 8]], np.int32))
    runner.execute(plan)
    assert model.config.num_hidden_layers > 1 and calls == {"at": 1, "masks": 1}

    rope = runner.model.rope.tables[0]  # the table holds half the rotary width: the other half repeats it
    positions = torch.tensor([0, 3, 17, 100])
    x = torch.randn(4, 5, 2 * rope.cos.shape[1])
    cos, sin = (torch.cat([t[positions], t[positions]], dim=-1).unsqueeze(1) for t in (rope.cos, rope.sin))
    torch.testing.assert_close(rope.at(positions, x.dtype).apply(x), x * cos + rotate_half(x) * sin,
                               rtol=0, atol=0)

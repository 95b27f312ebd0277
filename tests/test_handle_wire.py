"""Updates by handle without a server: a handle is msgpack of plain fields (CUDA IPC's as `reduce_tensor` gives them,
rebuilt with exactly those arguments), the front door's checks refuse anything but the trainer's segments and
matching byte counts, and every TP=2 shard staged from the handles equals one loaded from the checkpoint, staging
nothing but views. The CUDA branch runs here up to the IPC open itself, which a CPU stand-in replaces."""

from __future__ import annotations

import os

import msgpack
import pytest
import torch
from safetensors.torch import load_file
from torch.multiprocessing import reductions

from cluster.errors import Code
from cluster.handle_wire import check_handles
from cluster.protocol import ProtocolError
from launch.weight_handles import SharedBuckets
from tests.test_push_backend import TP, shard_models
from worker import handles
from worker.loader import apply


def reduced_cuda(nbytes: int) -> tuple:
    """What `reduce_tensor` returns for a flat uint8 CUDA tensor of `nbytes` (made by hand: no GPU here)."""
    return (reductions.rebuild_cuda_tensor,
            (torch.Tensor, torch.Size([nbytes]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 1, b"ipc-handle",
             nbytes + 512, 512, False, b"/torch_refcount", 7, b"event", True))


def test_a_cuda_handle_is_plain_fields_and_rebuilds_with_reduce_tensors_arguments():
    fn, args = reduced_cuda(4096)
    wire = msgpack.unpackb(msgpack.packb(handles.encode_cuda((fn, args))))  # no pickle: msgpack takes it as is
    assert wire["kind"] == "cuda" and wire["nbytes"] == 4096 and wire["device"] == 1
    assert handles.cuda_rebuild_args(wire) == args
    with pytest.raises(ValueError):  # a view into a larger tensor is not a bucket
        handles.encode_cuda((fn, (args[0], torch.Size([8]), (1,), 16, *args[4:])))


@pytest.fixture(scope="module")
def dirs(make_checkpoint):
    return make_checkpoint("llama"), make_checkpoint("llama", seed=1)


def test_wire_checks_refuse_foreign_names_and_wrong_sizes(dirs):
    state = load_file(os.path.join(dirs[1], "model.safetensors"))
    with SharedBuckets(state, bucket_bytes=1 << 20) as shared:
        buckets, hs = check_handles(shared.buckets, shared.handles)
        assert hs == shared.handles and len(hs) == len(buckets) > 1
        cuda = handles.encode_cuda(reduced_cuda(hs[0]["nbytes"]))
        assert check_handles(shared.buckets[:1], [cuda])[1] == [cuda]
        bad = [
            (shared.buckets, hs[:-1]),  # one handle short
            (shared.buckets, [dict(hs[0], name="../../etc/passwd")] + hs[1:]),  # not a segment of the trainer's
            (shared.buckets, [dict(hs[0], nbytes=hs[0]["nbytes"] - 4)] + hs[1:]),  # not the bucket's bytes
            (shared.buckets, [dict(hs[0], kind="file")] + hs[1:]),
            (shared.buckets[:1], [dict(cuda, handle="text")]),  # a CUDA handle's bytes must be bytes
            (shared.buckets[:1], [{k: v for k, v in cuda.items() if k != "ref_counter_offset"}]),
        ]
        for b, h in bad:
            with pytest.raises(ProtocolError) as info:
                check_handles(b, h)
            assert info.value.code == Code.BAD_FIELD


def test_every_shard_staged_from_handles_equals_the_checkpoint(dirs, monkeypatch):
    """Shared memory on one rank and the CUDA branch (rebuilt from its fields, the IPC open replaced by the same
    bytes on the CPU) on the other: both stage views only, and apply gives the checkpoint's shard exactly."""
    dir_a, dir_b = dirs
    state = load_file(os.path.join(dir_b, "model.safetensors"))
    models, want = shard_models(dir_a), shard_models(dir_b)
    with SharedBuckets(state, bucket_bytes=1 << 20) as shared:
        flats = {h["name"]: handles.open_shm(h) for h in shared.handles}
        opened = []

        def rebuild(*args):  # the stand-in for cudaIpcOpenMemHandle: the bucket that handle names
            opened.append(args)
            return flats[args[7].decode()]

        monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
        as_cuda = [dict(handles.encode_cuda(reduced_cuda(h["nbytes"])), handle=h["name"].encode())
                   for h in shared.handles]
        for r, hs in enumerate((shared.handles, as_cuda)):
            staged = handles.stage_handles(models[r], shared.buckets, hs, partial=False)
            stores = {v.untyped_storage().data_ptr() for _, v in staged}
            assert len(stores) <= len(hs) + 2  # views of the buckets (the vocabulary's zero padding aside)
            apply(staged)
            del staged
        assert len(opened) == len(as_cuda)
        flats.clear()
    for r in range(TP):
        for (k, got), w in zip(models[r].state_dict().items(), want[r].state_dict().values()):
            assert torch.equal(got, w), (r, k)

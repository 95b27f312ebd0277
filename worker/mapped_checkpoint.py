"""A safetensors file as views into one read-only mapping of it: staging a checkpoint costs no copy, and `apply`'s
copy into the parameters is the only pass over the bytes (the page cache's pages are mapped, not read into a buffer
first). The format (an 8-byte little-endian header length, a JSON header of {name: {dtype, shape, data_offsets}},
then the data) is checked against the file's size before any view is made, so a truncated file is refused while
staging, never while copying."""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
MAX_HEADER = 100 << 20


def read_only_view(fd: int, nbytes: int) -> torch.Tensor:
    """The first `nbytes` of an open file as a flat uint8 tensor over a read-only shared mapping, its pages mapped
    in one pass (MAP_POPULATE). Nothing may write the tensor (torch cannot mark it read-only, so it warns; the
    warning is silenced here, once the reason is written down)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapped, dtype=torch.uint8)


def mapped_tensors(path: str | os.PathLike) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of every tensor of the file, in file order; ValueError naming the file if it is malformed."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path}: {size} bytes, not a safetensors file")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(MAX_HEADER, size - 8):
            raise ValueError(f"{path}: a header of {n} bytes in a file of {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: unreadable header: {e}") from None
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"])
        end = 8 + n + max((v["data_offsets"][1] for _, v in entries), default=0)
        if end > size:
            raise ValueError(f"{path}: truncated: its header needs {end} bytes, the file has {size}")
        data = read_only_view(f.fileno(), size)
    out = []
    for name, v in entries:
        dtype, shape, (a, b) = DTYPES.get(v["dtype"]), v["shape"], v["data_offsets"]
        if dtype is None:
            raise ValueError(f"{path}: tensor {name}: dtype {v['dtype']} is not supported")
        count = 1
        for d in shape:
            count *= d
        if b - a != count * dtype.itemsize or a < 0:
            raise ValueError(f"{path}: tensor {name}: {b - a} bytes for shape {shape} of {v['dtype']}")
        raw = data[8 + n + a:8 + n + b]
        try:
            out.append((name, raw.view(dtype).view(shape)))
        except RuntimeError:  # an offset not aligned to the dtype (other writers): this tensor alone is copied
            out.append((name, raw.clone().view(dtype).view(shape)))
    return out


def mapped_checkpoint(files: list[Path]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of every file, as views."""
    return [pair for path in files for pair in mapped_tensors(path)]

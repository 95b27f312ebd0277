"""Triton kernels on the CPU: Triton reads TRITON_INTERPRET when it is imported (and another test of this process may
have imported it already), so a test module runs its kernels in ONE child process, itself as a script
(`python -m tests.test_x FOLDER`), and reads back the `out.pt` it saved in FOLDER."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(module: str, folder: Path) -> object:
    """`python -m module folder` under TRITON_INTERPRET=1; what it saved to folder/out.pt."""
    assert importlib.util.find_spec("triton") is not None, "triton is in the test extra: pip install -e '.[test]'"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", module, str(folder)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(Path(folder) / "out.pt", weights_only=False)

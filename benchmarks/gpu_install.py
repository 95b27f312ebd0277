"""Install Lockstep on a GPU machine that has no network, without touching its torch and transformers
(gpu_proof.sh, step 1).

    python3 benchmarks/gpu_install.py --out install.json [--dry-run]

No pip call here can reach a package registry: every one has `--no-index`. A package the machine lacks can only
come from `wheels/` at the repository root (benchmarks/gpu_wheels.sh fills it on a CPU machine with network;
docs/gpu.md). The steps, the same in both modes (the dry run passes pip `--dry-run`, so nothing changes):

1. The installed torch and transformers must satisfy pyproject.toml's ranges (so pip has no reason to replace
   them): `range_problems`.
2. Lockstep itself: `pip install --no-index --no-deps --no-build-isolation -e .` (no download, no dependency
   resolution). Without setuptools it builds in isolation from a setuptools wheel in wheels/, and with neither
   it is left out. Not fatal either way: the proof runs from the source tree (gpu_proof.sh sets PYTHONPATH);
   only `lockstep serve` wants the installed command.
3. The light dependencies that cannot be imported: those with a wheel in wheels/ are installed from there
   (`--no-index --find-links wheels/`, under a constraints file that pins torch and transformers to the
   installed versions). A missing one the proof imports (PROOF_NEEDS) with no wheel is a failure; one only
   `lockstep serve` needs (SERVE_ONLY) is reported as not installed, and is no failure.
4. torch's and transformers' versions after must equal those before.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "wheels"
KEPT = ("torch", "transformers")  # what the machine ships and pip must leave alone
# import name -> distribution: what the proof's steps import (tests/test_gpu_compat.py runs them without the rest)
PROOF_NEEDS = {"msgpack": "msgpack", "safetensors": "safetensors", "tqdm": "tqdm", "accelerate": "accelerate",
               "tokenizers": "tokenizers"}
# what only `lockstep serve` (ZeroMQ front door, HTTP gateway, metrics) imports
SERVE_ONLY = {"zmq": "pyzmq", "fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client"}
NOT_NEEDED = "not needed by the proof; run benchmarks/gpu_wheels.sh on a CPU machine to carry them"
PIP_TIMEOUT_S = 120


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """Distribution name -> specifier string of pyproject.toml's dependencies."""
    from packaging.requirements import Requirement

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {(r := Requirement(d)).name: str(r.specifier) for d in deps}


def range_problems(versions: dict[str, str], pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """Why pip would replace one of `versions` (name -> installed version); [] when none would be."""
    from packaging.specifiers import SpecifierSet

    reqs = requirements(pyproject)
    problems = []
    for name, version in versions.items():
        spec = SpecifierSet(reqs.get(name, ""))
        if not spec.contains(version, prereleases=True):
            problems.append(f"{name} {version} is outside pyproject.toml's range {spec}")
    return problems


def installed_versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in KEPT}


def has_wheel(dist: str, wheels: Path | None = None) -> bool:
    """Whether `wheels` (default WHEELS) holds a wheel of `dist` (wheel file names spell the name normalized,
    with underscores)."""
    wheels = WHEELS if wheels is None else wheels
    stem = re.sub(r"[-_.]+", "_", dist).lower()
    return wheels.is_dir() and any(w.name.lower().startswith(stem + "-") for w in wheels.glob("*.whl"))


def missing(modules: dict[str, str]) -> list[str]:
    """The distributions of `modules` (import name -> distribution) that cannot be imported here."""
    return [dist for mod, dist in modules.items() if importlib.util.find_spec(mod) is None]


def pip_install(*args: str, dry: bool) -> subprocess.CompletedProcess:
    """`pip install --no-index ...` (with `--dry-run` when `dry`); never a registry, never unbounded."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--disable-pip-version-check",
           *(["--dry-run"] if dry else []), *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"pip ran past {PIP_TIMEOUT_S}s")


def last_line(r: subprocess.CompletedProcess) -> str:
    return (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["?"])[-1]


def would_install(pip_output: str) -> list[str]:
    """The distributions a `pip install --dry-run` report says it would install."""
    m = re.search(r"^Would install (.*)$", pip_output, re.M)
    return m.group(1).split() if m else []


@dataclasses.dataclass
class Report:
    """What the install did (or, in a dry run, would do); `fatal` lists what fails the proof."""

    done: list[str] = dataclasses.field(default_factory=list)
    fatal: list[str] = dataclasses.field(default_factory=list)


def install_lockstep(report: Report, dry: bool) -> None:
    """Step 2: Lockstep itself, editable, without its dependencies; never fatal (the proof uses the tree)."""
    if importlib.util.find_spec("setuptools") is not None:
        build = ["--no-build-isolation"]
    elif has_wheel("setuptools"):
        build = ["--find-links", str(WHEELS)]  # pip builds in isolation, with setuptools from wheels/
    else:
        report.done.append("lockstep not installed as a package (no setuptools, no setuptools wheel in wheels/; "
                           "the proof runs from the source tree)")
        return
    r = pip_install("--no-deps", *build, "-e", str(ROOT), dry=dry)
    if r.returncode != 0:
        report.done.append(f"lockstep not installed as a package (pip: {last_line(r)}; the proof runs from the "
                           "source tree)")
    elif dry:
        report.done.append(f"pip --dry-run would install {', '.join(would_install(r.stdout)) or 'nothing'}")
    else:
        report.done.append("pip install --no-index --no-deps -e . ok")


def install_light(report: Report, before: dict[str, str], dry: bool) -> None:
    """Step 3: the missing light dependencies, from wheels/ only."""
    need, serve = missing(PROOF_NEEDS), missing(SERVE_ONLY)
    carried = [d for d in need + serve if has_wheel(d)]
    installed: list[str] = []
    if carried:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("".join(f"{k}=={v}\n" for k, v in before.items()))
        r = pip_install("--find-links", str(WHEELS), "-c", f.name, *carried, dry=dry)
        Path(f.name).unlink()
        if r.returncode == 0:
            installed = carried
            report.done.append(f"{'would add' if dry else 'added'} {', '.join(carried)} from wheels/")
        else:
            failed = f"installing {', '.join(carried)} from wheels/ failed: {last_line(r)}"
            (report.fatal if set(carried) & set(need) else report.done).append(failed)
    no_wheel = [d for d in need if d not in carried]
    if no_wheel:
        report.fatal.append(f"{', '.join(no_wheel)} missing, needed by the proof, and no wheel in wheels/")
    left = [d for d in serve if d not in installed]
    if left:
        report.done.append(f"{', '.join(left)} not installed ({NOT_NEEDED})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    before = installed_versions()
    report = Report(fatal=range_problems(before))
    install_lockstep(report, args.dry_run)
    install_light(report, before, args.dry_run)
    after = installed_versions()
    kept = after == before
    versions = ", ".join(f"{k} {before[k]}" + ("" if after[k] == before[k] else f" -> {after[k]}") for k in KEPT)
    result = "; ".join(report.done + [versions + (" kept" if kept else " CHANGED")] + report.fatal)
    ok = kept and not report.fatal
    print(f"[{'PASS' if ok else 'FAIL'}] install: {result}")
    Path(args.out).write_text(json.dumps({"ok": ok, "result": result, "dry_run": args.dry_run}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

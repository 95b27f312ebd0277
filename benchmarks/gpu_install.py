"""Install Lockstep on a GPU machine without touching its torch and transformers (gpu_proof.sh, step 1).

    python benchmarks/gpu_install.py --out install.json [--dry-run]

- The installed torch and transformers must satisfy pyproject.toml's ranges (so pip has no reason to
  replace them); checked first, by `range_problems`.
- Real run: `pip install --no-deps --no-build-isolation -e .` (no download, no dependency resolution), then
  only the light dependencies that cannot be imported, under a constraints file that pins torch and
  transformers to the installed versions. Their versions after must equal those before.
- Dry run (CPU, tests): `pip install --dry-run --no-index --no-build-isolation -e .` must want to install
  Lockstep alone, nothing else.
"""

from __future__ import annotations

import argparse
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
KEPT = ("torch", "transformers")  # what the machine ships and pip must leave alone
LIGHT = {"zmq": "pyzmq", "msgpack": "msgpack", "safetensors": "safetensors", "tqdm": "tqdm",
         "accelerate": "accelerate"}  # import name -> distribution


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


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def would_install(pip_output: str) -> list[str]:
    """The distributions a `pip install --dry-run` report says it would install."""
    m = re.search(r"^Would install (.*)$", pip_output, re.M)
    return m.group(1).split() if m else []


def dry_run() -> tuple[bool, str]:
    r = pip("install", "--dry-run", "--no-index", "--no-build-isolation", "-e", str(ROOT))
    if r.returncode != 0:
        return False, "pip --dry-run failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    wanted = would_install(r.stdout)
    others = [w for w in wanted if not w.startswith("lockstep")]
    return not others, f"pip --dry-run would install {', '.join(wanted) or 'nothing'}"


def real_install(before: dict[str, str]) -> tuple[bool, str]:
    r = pip("install", "--no-deps", "--no-build-isolation", "-e", str(ROOT))
    if r.returncode != 0:
        return False, "pip install --no-deps -e . failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    missing = [dist for mod, dist in LIGHT.items() if importlib.util.find_spec(mod) is None]
    if missing:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("".join(f"{k}=={v}\n" for k, v in before.items()))
        r = pip("install", "-c", f.name, *missing)
        if r.returncode != 0:
            return False, f"installing {missing} failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return True, f"pip install --no-deps -e . ok; added {', '.join(missing) or 'nothing'}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    before = installed_versions()
    problems = range_problems(before)
    ok, what = dry_run() if args.dry_run else real_install(before)
    after = installed_versions()
    kept = after == before
    result = (f"{what}; " + ", ".join(f"{k} {before[k]}" + ("" if after[k] == before[k] else f" -> {after[k]}")
                                      for k in KEPT)
              + (" kept" if kept else " CHANGED") + ("; " + "; ".join(problems) if problems else ""))
    ok = ok and kept and not problems
    print(f"[{'PASS' if ok else 'FAIL'}] install: {result}")
    Path(args.out).write_text(json.dumps({"ok": ok, "result": result}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

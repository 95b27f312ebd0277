"""The house's rules, read from the code (ast): packages by role on floors, no import up a floor, no circles,
and `import cluster` light enough for a client (docs/architecture.md, "The house")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "worker", "driver", "launch", "benchmarks")

# The documented order, lowest first: a module may import its own room, or any room below it. A room is a
# package or subpackage; the first listed prefix that names a module is its room.
FLOORS = (
    "cluster",            # what every process shares: config, plan, protocol, outputs, errors, groups
    "cluster.client",     # the client library (pyzmq, no torch)
    "worker",             # one rank's shard: model, KV cache, runner
    "driver.engine",      # rank 0's step: scheduler, block manager, sampler
    "driver.api",         # the manager API: ClusterModel, ContinuousBatchingManager, the loop threads
    "driver.frontdoor",   # the ZeroMQ front door in front of the manager
    "launch",             # processes: CLI, torchrun and Ray launchers, serve
    "launch.gateway",     # the OpenAI HTTP gateway (a client of the front door)
    "launch.router",      # the replicas' router (a client of each replica's front door)
    "benchmarks",
)
# launch's rooms are processes that start one another (serve starts the gateway, the replicas' launcher starts
# both): they share one floor; only circles between their modules are refused.
SAME_FLOOR = {"launch", "launch.gateway", "launch.router"}


def module_files() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every project module `path` imports, at the top, inside functions and under TYPE_CHECKING alike."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in PACKAGES and n in modules)
    return out


def room(module: str) -> str:
    return max((r for r in FLOORS if module == r or module.startswith(r + ".")), key=len)


def floor(module: str) -> int:
    r = room(module)
    return FLOORS.index("launch") if r in SAME_FLOOR else FLOORS.index(r)


def test_every_module_has_a_room():
    assert all(m.split(".")[0] in PACKAGES for m in module_files())
    assert room("driver.engine.scheduler") == "driver.engine" and room("launch.serve") == "launch"


def test_no_import_up_a_floor():
    modules = module_files()
    up = [f"{m} ({room(m)}) imports {i} ({room(i)})"
          for m, path in modules.items() for i in imports_of(path, modules) if floor(i) > floor(m)]
    assert not up, "imports up a floor:\n" + "\n".join(sorted(up))


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_circles():
    modules = module_files()
    # a package's __init__ re-exporting its own modules is not a circle (cluster.client -> cluster.client.client)
    graph = {m: {i for i in imports_of(p, modules) if not i.startswith(m + ".")} for m, p in modules.items()}
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_circle_finder_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.slow
def test_import_cluster_and_its_client_stay_light():
    """A client or a Ray task imports `cluster` and its client without torch, transformers or numpy, and so does
    the CLI (`lockstep submit` and the other client verbs start in a fraction of a second); the heavy public names
    (`cluster.load`, the manager) resolve on first use, by name (cluster/__init__.py)."""
    code = ("import sys, cluster, cluster.client, cluster.protocol, launch.cli\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
            "print(heavy)\n"
            "assert cluster.ContinuousBatchingManager.__name__ == 'ContinuousBatchingManager'\n"
            "print(callable(cluster.load), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True True"], out.stdout


MAX_LINES = 400  # one concept a file (DEVELOPERS' style rule), benchmarks and tests included


def test_no_python_file_is_over_the_line_limit():
    files = [p for d in (*PACKAGES, "tests", "configs") for p in (REPO / d).rglob("*.py")]
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split by concept): {long}"

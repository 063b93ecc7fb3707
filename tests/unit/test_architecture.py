"""The package boundaries the design draws, checked on the code itself.

- No import cycle between pdserve's packages (each subpackage, and each top-level module, is
  one node; every import counts, lazy ones too, since a lazy import is still a dependency).
- `protocol` is a leaf: it imports nothing of pdserve but `errors`, `clock` and `auth`.
- pdserve never imports the tooling beside it (`pdlab`).
- Importing the router, its entry point and the protocol leaves torch unloaded, and so does
  building the router's config from flags (what `pdserve router` does before it serves).
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pdserve"
PROTOCOL_MAY_IMPORT = {"pdserve.protocol", "pdserve.errors", "pdserve.clock", "pdserve.auth"}


def _node(module: str) -> str:
    return ".".join(module.split(".")[:2])


def import_edges() -> dict[str, dict[str, str]]:
    """node -> {imported node: the first module that imports it}, pdserve's own imports only."""
    edges: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                targets = [n.module]
            elif isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            else:
                continue
            for target in targets:
                top = target.split(".")[0]
                if top in ("pdserve", "pdlab") and _node(target) != _node(module):
                    edges[_node(module)].setdefault(_node(target), module)
    return edges


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle of `graph` as a node path (first == last), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one() -> None:
    assert find_cycle({"a": {"b": "a.x"}, "b": {"c": "b.y"}, "c": {"a": "c.z"}}) == [
        "a",
        "b",
        "c",
        "a",
    ]
    assert find_cycle({"a": {"b": "a.x"}, "b": {"c": "b.y"}, "c": {}}) is None


def test_no_import_cycle_between_packages() -> None:
    edges = import_edges()
    cycle = find_cycle(edges)
    if cycle is not None:
        hops = [f"{a} -> {b} (in {edges[a][b]})" for a, b in itertools.pairwise(cycle)]
        pytest.fail("import cycle: " + "; ".join(hops))


def test_protocol_is_a_leaf() -> None:
    extra = {n: m for n, m in import_edges()["pdserve.protocol"].items()}
    assert set(extra) <= PROTOCOL_MAY_IMPORT, extra


def test_pdserve_never_imports_the_tooling() -> None:
    users = {n: deps["pdlab"] for n, deps in import_edges().items() if "pdlab" in deps}
    assert users == {}


def test_router_protocol_and_cli_do_not_load_torch(tiny_model_path: Path) -> None:
    code = (
        "import sys\n"
        "import pdserve.protocol.worker_api, pdserve.protocol.request_state\n"
        "import pdserve.protocol.checkpoint_api, pdserve.protocol.reservation_signing\n"
        "import pdserve.router.app, pdserve.cli.main\n"
        "from pdserve.router.main import config_from_args\n"
        f"config_from_args(['--model', {str(tiny_model_path)!r}, '--worker',"
        " 'http://127.0.0.1:1'])\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_only_progress_writes_a_request_timeline() -> None:
    """`router/flows/progress.py` is the one writer of `RequestTimeline`: nothing else in pdserve
    calls its mutators on a timeline."""
    mutators = {"advance", "retry", "fail", "record_tokens"}
    writers = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in mutators
                and ast.unparse(node.func.value).endswith("timeline")
            ):
                writers.add(str(path.relative_to(PACKAGE.parent)))
    assert writers == {"pdserve/router/flows/progress.py"}, writers

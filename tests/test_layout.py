"""The architecture holds: no import circle between the project's modules (function-local
imports counted), and the orchestration never names a stage (the stages describe themselves)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from sdl_design.stages import RELEASE_STAGES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sdl_design", "flows", "tasks", "expectations")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Every project module a module imports, wherever the import is (TYPE_CHECKING aside)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        skip = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {t for n in names if (t := _resolve(n, mods)) and t != m}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_circle_finder_finds_a_circle():
    graph = defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_import_circle():
    """Every module imports downward only, function-local imports included; the methods
    never import the orchestration."""
    mods = _modules()
    graph = _imports(mods)
    assert _circles(graph) == []
    up = {m: sorted(t for t in ts if not t.startswith("sdl_design")) for m, ts in graph.items()}
    assert {m: ts for m, ts in up.items() if m.startswith("sdl_design") and ts} == {}


def _string_literals(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_orchestration_never_names_a_stage():
    """The public README and codebook, the monitor, the registry, the tasks and the suites read
    what the stages say of themselves, never a stage's name."""
    names = {cls.name for cls in RELEASE_STAGES}
    files = [p for pkg in ("flows", "tasks", "expectations") for p in (ROOT / pkg).rglob("*.py")]
    files.append(ROOT / "sdl_design" / "preflight.py")  # the preflight asks the stages too
    files += list((ROOT / "sdl_design" / "engine").rglob("*.py"))  # the engine runs any stage
    found = {str(p.relative_to(ROOT)): sorted(_string_literals(p) & names) for p in files}
    named = {k: v for k, v in found.items() if v}
    assert named == {}

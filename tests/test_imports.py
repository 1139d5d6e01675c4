"""No import cycles among hyserve's modules.

The graph is read from the source with ``ast``, not by importing: an edge ``a -> b`` for every ``import b`` /
``from b import x`` (and ``from a.b import c`` where ``a.b.c`` is a module) anywhere in ``a``'s file, at the top,
inside functions, or under ``if TYPE_CHECKING:``. An import of ``a.b.c`` counts as an edge to ``a.b.c`` only, not
to the packages above it (every module would otherwise reach ``hyserve/__init__.py`` and through it the whole engine).

Two checks: the graph of top-level imports (what runs when a module is imported) has no cycle at all; and in the
full graph (function-level and type-only imports too) the pairs that once formed circles are in no cycle together:
the command line and the tools share ``hyserve.engine_args`` instead of importing each other, and the metrics read
the engine through a Protocol. And no module imports another's private (underscore) names: helpers that tests,
benchmarks and training share are public. The two halves of the engine stay apart: no import path leads from the
worker side to requests, the scheduler, the prefix cache or the engine, and the cache layer imports nothing above it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "hyserve"


def module_files() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


@functools.cache
def parsed(path: Path) -> ast.Module:
    """``path``'s syntax tree, read once per session: the checks below walk the same files (about 1.5 s a full read
    on a CI core) and none changes a tree."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imported_modules(name: str, path: Path, known: set[str], top_level_only: bool) -> set[str]:
    tree = parsed(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known and m != name}


def import_graph(top_level_only: bool) -> dict[str, set[str]]:
    """A fresh copy each call (a test may change its copy)."""
    return {name: set(deps) for name, deps in _import_graph(top_level_only).items()}


@functools.cache
def _import_graph(top_level_only: bool) -> dict[str, frozenset[str]]:
    mods = module_files()
    known = set(mods)
    return {name: frozenset(imported_modules(name, path, known, top_level_only)) for name, path in mods.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The graph's cycles, as its strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component: set[str] = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.add(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        components.append(component)
    return components


def test_the_graph_reader_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [{"a", "b", "c"}]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_the_graph_covers_the_modules_and_their_imports() -> None:
    graph = import_graph(top_level_only=False)
    assert "hyserve.cli" in graph and "hyserve.tools.bench" in graph and "hyserve.engine.metrics" in graph
    assert "hyserve.engine_args" in graph["hyserve.cli"]
    assert "hyserve.tools.bench" in graph["hyserve.cli"]  # a function-level import, seen
    assert "hyserve.engine.metrics" in graph["hyserve.engine.llm_engine"]


def test_top_level_imports_have_no_cycle() -> None:
    assert strongly_connected(import_graph(top_level_only=True)) == []


@pytest.mark.parametrize("a, b", [
    ("hyserve.cli", "hyserve.tools.bench"),
    ("hyserve.cli", "hyserve.tools.soak"),
    ("hyserve.engine.llm_engine", "hyserve.engine.metrics"),
    ("hyserve.engine.llm_engine", "hyserve.speculative.drafts"),
    ("hyserve.engine.llm_engine", "hyserve.scheduler.scheduler"),
])
def test_no_cycle_through_once_circular_pairs(a: str, b: str) -> None:
    """Function-level and ``TYPE_CHECKING`` imports included."""
    for component in strongly_connected(import_graph(top_level_only=False)):
        assert not {a, b} <= component, f"{a} and {b} import each other (cycle: {sorted(component)})"


def private_imports(path: Path) -> list[str]:
    """``from m import _x`` in ``path`` where ``m`` is another module: a name private to ``m`` used outside it. A
    kernel module importing from its own op's Triton module (``hyserve.kernels.<op>._triton``, private to the op's
    package) is the one pattern allowed."""
    found = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.module == f"hyserve.kernels.{path.parent.name}._triton":
                continue
            found += [f"{path.name}:{node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_names_imported_across_modules() -> None:
    repo = ROOT.parent
    files = [p for d in ("hyserve", "tests", "benchmarks", "training") for p in sorted((repo / d).rglob("*.py"))]
    assert len(files) > 50
    assert [hit for path in files for hit in private_imports(path)] == []


def test_modules_from_another_folder(tmp_path: Path) -> None:
    """The check below sees a test module importing another folder's test module (sabotage of the layout)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "test_one.py").write_text("X = 1\n")
    (tmp_path / "b" / "test_two.py").write_text("from test_one import X\n")
    assert cross_folder_test_imports(tmp_path) == ["b/test_two.py:1: from test_one"]


def cross_folder_test_imports(tests: Path) -> list[str]:
    """``from test_x import ...`` where test_x.py is not in the importing module's own folder."""
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0].startswith(("test_", "conftest")) \
                    and not (path.parent / f"{node.module.split('.')[0]}.py").exists():
                found.append(f"{path.relative_to(tests).as_posix()}:{node.lineno}: from {node.module}")
    return found


def test_tests_share_helpers_through_hyserve_testing() -> None:
    """Tests mirror the package, one folder per room; what several folders share is public in hyserve.testing, so
    no test module imports a test module of another folder."""
    assert cross_folder_test_imports(ROOT.parent / "tests") == []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


WORKER_SIDE = ["hyserve.worker.worker", "hyserve.worker.model_runner", "hyserve.executor.uniproc",
               "hyserve.worker.spec_decode.mtp_proposer"]
SCHEDULER_SIDE = {"hyserve.request", "hyserve.scheduler.scheduler", "hyserve.cache.prefix_cache",
                  "hyserve.cache.state_slots", "hyserve.engine.llm_engine", "hyserve.engine.output_processor"}


@pytest.mark.parametrize("module", WORKER_SIDE)
def test_the_worker_side_reaches_no_scheduler_state(module: str) -> None:
    """What the worker runs on is what the step sends it: no import path from the worker to requests, the scheduler,
    the prefix cache or the engine (full graph, function-level and type-only imports included)."""
    graph = import_graph(top_level_only=False)
    assert graph[module], f"{module} has no imports: the graph reader missed it"
    assert not reachable(graph, module) & SCHEDULER_SIDE, sorted(reachable(graph, module) & SCHEDULER_SIDE)


def test_the_cache_layer_imports_nothing_above_it() -> None:
    graph = import_graph(top_level_only=True)
    above = ("hyserve.engine", "hyserve.scheduler", "hyserve.worker", "hyserve.executor", "hyserve.server")
    bad = {m: sorted(d for d in deps if d.startswith(above)) for m, deps in graph.items()
           if m.startswith("hyserve.cache.")}
    assert all(not v for v in bad.values()), bad


def test_the_seam_check_sees_a_forbidden_path() -> None:
    """The check above fails when a worker module reaches a request (sabotage of the graph)."""
    graph = import_graph(top_level_only=False)
    graph["hyserve.worker.model_runner"] = graph["hyserve.worker.model_runner"] | {"hyserve.request"}
    assert reachable(graph, "hyserve.worker.worker") & SCHEDULER_SIDE


OWNED = ("num_computed_tokens", "block_table", "state_slot", "draft_token_ids", "num_inflight_tokens",
         "num_inflight_samples")


def attribute_writes(source: str | ast.Module) -> list[tuple[int, str]]:
    """(line, attribute) of every store to ``x.<attr>`` (assignment, augmented assignment, deletion of an item or
    slice of it, or a mutating call such as ``x.block_table.extend``) for the attributes in OWNED."""
    found = []
    for node in ast.walk(ast.parse(source) if isinstance(source, str) else source):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "append", "extend", "clear", "pop", "insert", "remove"):
            targets = [node.func.value]
        for t in targets:
            while isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute) and t.attr in OWNED:
                found.append((node.lineno, t.attr))
    return sorted(found)


def test_only_the_scheduler_writes_computed_counts_blocks_slots_and_drafts() -> None:
    """docs/design.md invariant 13: the scheduler is the only writer of a request's computed count, block table,
    state slot and drafts (dataclass defaults in ``hyserve/request.py`` aside)."""
    writers = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        if rel in ("hyserve/scheduler/scheduler.py", "hyserve/request.py"):
            continue
        hits = attribute_writes(parsed(path))
        if hits:
            writers[rel] = hits
    assert writers == {}


def test_the_writer_check_sees_writes() -> None:
    src = "req.num_computed_tokens = 3\nreq.block_table.extend([1])\ndel req.block_table[2:]\nr.state_slot += 1\n"
    assert [a for _, a in attribute_writes(src)] == ["num_computed_tokens", "block_table", "block_table",
                                                    "state_slot"]
    assert attribute_writes("x = req.block_table[0]\nf(req.state_slot)\n") == []

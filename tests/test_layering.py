"""Layering rules: telemetry out of the data path, no import cycle, no upward import, small modules, and tests
that take their helpers from tests/support/ only."""

from __future__ import annotations

import ast
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import mpcache

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(mpcache.__file__).resolve().parent
BENCHMARKS = REPO / "benchmarks"  # outside the wheel, held to the same rules as the package
SOURCES = (PACKAGE, BENCHMARKS)
FORBIDDEN = ("opentelemetry", "prometheus_client")
EXCLUDED = ("mpcache.telemetry",)

IMPORT_ALL = r'''
import importlib, json, sys
forbidden = tuple(sys.argv[1].split(","))
culprits = {}
for module in json.loads(sys.stdin.read()):
    importlib.import_module(module)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
    if loaded and not culprits:
        culprits = {"first_importer": module, "loaded": loaded[:5]}
print(json.dumps(culprits))
'''


def data_path_modules() -> list[str]:
    """Every mpcache module outside telemetry, found by walking the package."""
    found = ["mpcache"]
    for info in pkgutil.walk_packages(mpcache.__path__, "mpcache."):
        name = info.name
        if any(name == p or name.startswith(p + ".") for p in EXCLUDED) or name.endswith(".__main__"):
            continue
        found.append(name)
    return found


def test_module_discovery_covers_the_data_path():
    """The walk finds the ring, the publisher and the event catalogue (so the next test means something)."""
    modules = set(data_path_modules())

    assert {"mpcache.shm.ring", "mpcache.shm.publish", "mpcache.contract.events"} <= modules
    assert not any(m.startswith(EXCLUDED) for m in modules)


def test_data_path_imports_no_opentelemetry_or_prometheus():
    """In a clean interpreter, importing every non-telemetry mpcache module loads neither
    opentelemetry nor prometheus_client (nor any submodule of them)."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, ",".join(FORBIDDEN)],
        input=json.dumps(data_path_modules()), capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert 0 == result.returncode, result.stderr[-3000:]

    assert {} == json.loads(result.stdout)


PICKLE = re.compile(r"^\s*(import|from)\s+(c?pickle|_pickle|cPickle)\b|\bc?[pP]ickle\.(loads?|dumps?)\b|\bcPickle\b",
                    re.MULTILINE)


def test_package_source_has_no_pickle():
    """No mpcache or benchmark source file imports pickle or calls pickle.load(s)/dump(s): shared bytes are never
    unpickled."""
    hits = [
        f"{path.relative_to(REPO)}:{source.count(chr(10), 0, match.start()) + 1}: {match.group(0).strip()}"
        for root in SOURCES for path in sorted(root.rglob("*.py"))
        for source in [path.read_text(encoding="utf-8")]
        for match in PICKLE.finditer(source)
    ]

    assert [] == hits


# Packages (and top-level modules) by layer, lowest first: a module imports its own package or a lower layer
# only.  Processes (one layer) never import one another; the shared layers below them know no process.
LAYERS = (
    ("mpcache", "mpcache.errors"),
    ("mpcache.contract",),
    ("mpcache.shm",),
    ("mpcache.config", "mpcache.logs", "mpcache.systemd", "mpcache.httpserver", "mpcache.parentage"),
    ("mpcache.client", "mpcache.eviction"),
    ("mpcache.cache", "mpcache.telemetry", "mpcache.demo"),
    ("mpcache.supervisor",),
    ("mpcache.tools",),
    ("benchmarks",),
)
# A bound on a module's growth, not a size to split by: a module splits where its responsibilities part (at 400
# lines, six modules were being cut to fit, not on a seam); past this many lines it holds more than one.
MAX_MODULE_LINES = 600


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (path for root in SOURCES for path in root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _module_imports() -> dict[str, set[str]]:
    """Module → the mpcache and benchmark modules it names: every import statement wherever it stands (module level,
    inside functions, under ``TYPE_CHECKING``), relative ones resolved, and every string that is exactly a
    module's name (``python -m NAME`` children), so that nothing hides a dependency."""
    import ast

    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else base)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
                targets.add(node.value)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _in(module: str, entry: str) -> bool:
    """``module`` is the entry of LAYERS or inside it (the root package's entry is its ``__init__`` alone)."""
    return module == entry or (entry != "mpcache" and module.startswith(entry + "."))


def _layer_of(module: str) -> tuple[int, str]:
    """The layer and the package (or top-level module) of ``module``."""
    [(rank, entry)] = [(rank, entry) for rank, entries in enumerate(LAYERS) for entry in entries if _in(module, entry)]
    return rank, entry


def test_the_import_graph_sees_imports_inside_functions_under_type_checking_and_module_names_in_strings():
    """The graph the next tests read has the edges a top-level-only reading misses: imports inside a function
    (telemetry's exporters, loaded once configured), under ``TYPE_CHECKING`` (the ops registry's context), and
    child processes named by their module's string (the supervisor's programs)."""
    graph = _module_imports()

    assert "mpcache.telemetry.otel" in graph["mpcache.telemetry.__main__"]
    assert "mpcache.cache.context" in graph["mpcache.cache.native.ops.registry"]
    assert {"mpcache.cache", "mpcache.telemetry", "mpcache.demo"} <= graph["mpcache.supervisor.children"]
    assert {"benchmarks.null_cache", "benchmarks.reference_cache"} <= graph["benchmarks.service"]


def test_no_import_cycles():
    """No mpcache module imports a module that imports it back, directly or not, counting every import."""
    graph = _module_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert [] == cycles


def test_every_package_has_a_layer():
    """A new package or top-level module gets its place in LAYERS (else the next test could not judge it)."""
    unplaced = [name for name in _modules() if not any(_in(name, entry) for entries in LAYERS for entry in entries)]
    assert [] == unplaced


def test_no_upward_import():
    """Every import goes to the importer's own package or to a lower layer: the shared layers know no process,
    a process no other process, the service no benchmark."""
    graph = _module_imports()
    upward = sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                    if (layers := (_layer_of(name), _layer_of(target)))[0][1] != layers[1][1]
                    and layers[1][0] >= layers[0][0])
    assert [] == upward


def test_contract_imports_nothing_of_the_processes():
    """What the processes agree on depends on nothing but itself and the error types."""
    graph = _module_imports()
    reached = {target for name, targets in graph.items() if name.startswith("mpcache.contract") for target in targets}
    assert set() == {t for t in reached if not t.startswith("mpcache.contract") and t != "mpcache.errors"}


def test_the_service_imports_nothing_from_the_benchmarks():
    """Benchmarks may import the service, never the other way round (module names in strings included)."""
    graph = _module_imports()
    assert {} == {name: sorted(t for t in targets if _in(t, "benchmarks"))
                  for name, targets in graph.items()
                  if not _in(name, "benchmarks") and any(_in(t, "benchmarks") for t in targets)}


def test_no_module_grows_past_the_line_bound():
    """One responsibility per module: no module of any package (the benchmarks' included) grows past
    MAX_MODULE_LINES.  The harness's scripts (``benchmarks/harness/``, no package: the tests' side of LMCache
    and vLLM, run in their venvs) are bound as the tests are, not as modules."""
    long = {str(path.relative_to(REPO)): lines for root in SOURCES for path in sorted(root.rglob("*.py"))
            if (path.parent / "__init__.py").exists()
            and (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert {} == long
    stated = re.findall(r"no module grows past (\d+) lines", (REPO / "docs" / "ARCHITECTURE.md").read_text())
    assert [str(MAX_MODULE_LINES)] == stated


def _helper_imports(path: Path) -> list[str]:
    """The imports of a file under tests/ that reach a helper outside tests/support/: any import of a ``test_*``
    module, and from a test module or conftest a relative import or one through the ``tests`` package."""
    test_module = path.name.startswith("test_") or path.name == "conftest.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module or ''}.{alias.name}" for alias in node.names]
            relative = node.level > 0
        elif isinstance(node, ast.Import):
            names, relative = [alias.name for alias in node.names], False
        else:
            continue
        if any(part.startswith("test_") for name in names for part in name.split(".")) or test_module and (
                relative or any(name.split(".")[0] == "tests" for name in names)):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_test_modules_import_helpers_only_from_support():
    """A helper two test modules share lives in tests/support/ (imported as ``support.*``): no file of tests/
    imports a test module, and no test module or conftest imports a sibling by a relative path or through the
    ``tests`` package."""
    files = [path for path in sorted((REPO / "tests").rglob("*.py")) if "support" not in path.relative_to(REPO).parts]
    assert [] == [hit for path in files for hit in _helper_imports(path)]

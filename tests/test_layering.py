"""Layering rules that keep telemetry out of the data path."""

from __future__ import annotations

import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import mpcache

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(mpcache.__file__).resolve().parent
FORBIDDEN = ("opentelemetry", "prometheus_client")
EXCLUDED = ("mpcache.telemetry", "mpcache.bench")

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
    """Every mpcache module outside telemetry and bench, found by walking the package."""
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
    """No mpcache source file imports pickle or calls pickle.load(s)/dump(s): shared bytes are never unpickled."""
    hits = [
        f"{path.relative_to(REPO)}:{source.count(chr(10), 0, match.start()) + 1}: {match.group(0).strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for source in [path.read_text(encoding="utf-8")]
        for match in PICKLE.finditer(source)
    ]

    assert [] == hits


def _module_imports() -> dict[str, set[str]]:
    """Module → the mpcache modules it imports at module level (``TYPE_CHECKING`` blocks and imports inside
    functions do not run at import time, so they cannot close a cycle)."""
    import ast

    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:  # top-level statements only
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_no_import_cycles():
    """No mpcache module imports, at module level, a module that imports it back (directly or not)."""
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


def test_the_service_imports_nothing_from_the_benchmarks():
    """Benchmarks may import the service, never the other way round."""
    graph = _module_imports()
    assert {} == {name: sorted(t for t in targets if t.startswith("mpcache.bench"))
                  for name, targets in graph.items()
                  if not name.startswith("mpcache.bench") and any(t.startswith("mpcache.bench") for t in targets)}


def test_cache_process_modules_stay_small():
    """One responsibility per module: no module of the cache process grows past 400 lines."""
    long = {str(path.relative_to(REPO)): lines for path in sorted((PACKAGE / "cache").rglob("*.py"))
            if (lines := len(path.read_text(encoding="utf-8").splitlines())) > 400}
    assert {} == long

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

"""The environment deploy/docker/Dockerfile's final stage sets (``ENV A=1 B=2``, continuation lines joined):
the MPCACHE_* settings every container of the mpcache image starts with, under the manifests' own."""

from __future__ import annotations

import re
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "Dockerfile"


def image_environment() -> dict[str, str]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    final = text.split("\nFROM ")[-1]
    return dict(word.split("=", 1) for line in final.splitlines() if line.startswith("ENV ")
                for word in line[4:].split())

"""The documentation holds together: every relative link of the README and of the docs resolves to a file of
the repository (and a #fragment to a heading of it), the flags the configuration tables document exist, and
the README's test command is the one CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "deploy").rglob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks (a ``#`` there is a comment, not a heading)."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the file's headings: lower case, only letters, digits, marks, ``-`` and ``_``
    kept (``½`` and ``×`` go), spaces as hyphens, and a repeated heading's anchor suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path):
        match = re.match(r"#{1,6} (.+)$", line)
        if match:
            base = "".join(char for char in match.group(1).strip().lower() if char in "-_ " or
                           unicodedata.category(char)[0] in "LM" or unicodedata.category(char) in ("Nd", "Nl"))
            base = base.replace(" ", "-")
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    return [target for line in prose_lines(path) for target in LINK.findall(line)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_the_anchor_rule_is_githubs():
    """Headings with code, punctuation and a repeat get the anchors GitHub gives them."""
    readme = anchors(REPO / "README.md")
    assert {"quick-start", "use-it-from-vllm", "capacity-planning-miss-ratio-curves-and-miss-reasons"} <= readme
    ops = anchors(REPO / "deploy" / "OPERATIONS.md")
    assert {"what-metrics-holds-besides-lmcaches-metrics", "mpcachetargetdown"} <= ops
    assert "mrc-miss-ratio-curves-against-exact-lru-and-against-re-runs-at--and-2-l1" in anchors(
        REPO / "docs" / "PERFORMANCE.md")


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_relative_link_resolves_inside_the_repository(document):
    """Each relative link names a file or directory of this repository (never one outside it, which a clone
    lacks), and a #fragment names a heading of its target."""
    links = relative_links(document)
    broken = []
    for target in links:
        name, _, fragment = target.partition("#")
        resolved = (document.parent / name).resolve() if name else document
        if REPO not in (resolved, *resolved.parents) or not resolved.exists():
            broken.append(f"{target}: no such file in the repository")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {resolved.relative_to(REPO)}")
    assert [] == broken


def test_the_readme_links_to_every_document_in_docs():
    """Every file of docs/ is reachable from the README's own links."""
    linked = {(REPO / target.partition("#")[0]).resolve() for target in relative_links(REPO / "README.md")}
    assert [] == sorted(path.name for path in (REPO / "docs").glob("*.md") if path.resolve() not in linked)


def documented_flags() -> set[str]:
    """The flags named in the first column of the README's and docs/CONFIGURATION.md's tables."""
    flags = set()
    for path in (REPO / "README.md", REPO / "docs" / "CONFIGURATION.md"):
        for line in prose_lines(path):
            if line.startswith("| `--"):
                flags.update(re.findall(r"`(--[a-z0-9-]+)", line.split("|")[1]))
    return flags


def test_start_cache_help_lists_every_flag_the_configuration_tables_document():
    """Each flag of the configuration tables is one start-cache accepts (--help names it)."""
    flags = documented_flags()
    result = subprocess.run([sys.executable, str(REPO / "bin" / "start-cache"), "--help"], capture_output=True,
                            text=True, timeout=60)
    assert 0 == result.returncode
    assert {"--workers", "--l1-size", "--l2", "--lmcache-port", "--otlp-endpoint"} <= flags
    assert [] == sorted(flag for flag in flags if not re.search(rf"{flag}\b", result.stdout))


def test_ci_runs_the_readme_test_command():
    """The README's Quick start has two commands, the second is the test command, and .ci/run states that
    command and ends by running its pytest."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    quick_start = readme[readme.index("## Quick start"):]
    block = quick_start[quick_start.index("```sh\n") + 6:]
    commands = block[:block.index("```")].splitlines()
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert 2 == len(commands) and "bin/start-cache --demo" in commands[0]
    assert f"#   {commands[1]}\n" in ci
    assert commands[1].rsplit(" && ", 1)[1] == ci.rstrip().splitlines()[-1]

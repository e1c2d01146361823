"""The alerts' runbook, served by the supervisor's front at ``/runbook``: what to do when each alert of
``deploy/prometheus/alerts.yml`` fires, one section per alert with the alert's name, lower-cased, as its
anchor — the rules' default ``runbook_url`` is ``http://<instance>/runbook#<alert>``, a page every deployment
serves, where a relative path into a repository was a dead link in Alertmanager and Grafana.

The text is ``deploy/OPERATIONS.md``'s section "Alerts: what to do when they fire", packaged as
``runbook.md`` here (``python -m mpcache.supervisor.runbook deploy/OPERATIONS.md >
mpcache/supervisor/runbook/runbook.md`` copies it; a test holds the two equal).
"""

from __future__ import annotations

import html
import importlib.resources
import re

SECTION = "## Alerts: what to do when they fire"


def extract(operations: str) -> str:
    """The alerts section of OPERATIONS.md's text, up to the next section of its level."""
    start = operations.index(SECTION)
    end = operations.find("\n## ", start + len(SECTION))
    return operations[start:end if end >= 0 else len(operations)].rstrip() + "\n"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, spaces as dashes, other punctuation dropped."""
    return re.sub(r"[^a-z0-9 -]", "", heading.strip().lower()).replace(" ", "-")


def page(markdown: str) -> bytes:
    """The runbook as a small HTML page: headings with their anchors as ids, everything else as it is
    written (escaped), so that ``/runbook#mpcachetargetdown`` opens at that alert's section."""
    parts = ["<!doctype html><meta charset=utf-8><title>mpcache alert runbook</title><body>"]
    for block in markdown.split("\n\n"):
        heading = re.fullmatch(r"(#{2,3}) (.+)", block.strip())
        if heading:
            level = len(heading.group(1))
            parts.append(f'<h{level} id="{anchor(heading.group(2))}">{html.escape(heading.group(2))}</h{level}>')
        else:
            parts.append(f"<pre style='white-space: pre-wrap'>{html.escape(block.strip())}</pre>")
    return "\n".join(parts).encode()


def packaged() -> str:
    """The runbook shipped with the package."""
    return importlib.resources.files(__name__).joinpath("runbook.md").read_text(encoding="utf-8")

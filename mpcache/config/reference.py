"""``python -m mpcache.config.reference``: the reference tables of docs/CONFIGURATION.md (every setting, and
the ``MPCACHE_*`` variables that are not settings), made from the table itself so that they cannot drift.
"""

from __future__ import annotations

from mpcache.config.model import SETTINGS
from mpcache.config.setting import FOREIGN_PREFIXES, OTHER_VARIABLES, shown

BEGIN, END = "<!-- settings reference: python -m mpcache.config.reference -->", "<!-- end of settings reference -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The block between BEGIN and END in docs/CONFIGURATION.md."""
    lines = [BEGIN, "", "| flag | variable | default | accepts | meaning |", "|---|---|---|---|---|"]
    for item in SETTINGS:
        flag = item.flag + (" (repeatable)" if item.repeated else "")
        cells = (f"`{flag}`", f"`{item.env}`", shown(item.kind, item.default), item.kind.expected, item.help)
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    lines += ["", "`MPCACHE_*` variables that are not settings (start-cache accepts them in its environment):", "",
              "| variable | what it is |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(meaning)} |" for name, meaning in OTHER_VARIABLES.items()]
    prefixes = " and ".join(f"`{prefix}*`" for prefix in FOREIGN_PREFIXES)
    lines += ["", f"Variables named {prefixes} belong to the project's tests and CI (docs/DEVELOPMENT.md); "
              "start-cache passes over them."]
    return "\n".join([*lines, "", END])


if __name__ == "__main__":
    print(markdown())

"""``python -m mpcache.telemetry.metric_table --markdown > docs/METRICS.md``: print the metrics reference."""

from __future__ import annotations

import argparse
import sys

from mpcache.telemetry.metric_table import SECTIONS
from mpcache.telemetry.metric_table.markdown import render_markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpcache.telemetry.metric_table",
                                     description="Print the metrics reference generated from the metric table.")
    parser.add_argument("--markdown", action="store_true", help="print docs/METRICS.md")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return 2
    sys.stdout.write(render_markdown(SECTIONS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m mpcache.bench {publish,drain,e2e} [--json]``."""

from __future__ import annotations

import argparse
import json
import sys

from mpcache.bench import drain, e2e, publish

BENCHMARKS = {"publish": publish, "drain": drain, "e2e": e2e}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpcache.bench")
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark to run")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--repetitions", type=int, default=5, help="repetitions; medians are reported (default 5)")
    args = parser.parse_args(argv)
    module = BENCHMARKS[args.name]
    result = module.run(repetitions=args.repetitions, progress=lambda msg: print(msg, file=sys.stderr))
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for key, value in result.items():
            print(f"{key:>32}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

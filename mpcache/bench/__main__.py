"""``python -m mpcache.bench {publish,drain,e2e,soak,scrape} [--json]``."""

from __future__ import annotations

import argparse
import json
import sys

from mpcache.bench import drain, e2e, publish, scrape, soak

BENCHMARKS = {"publish": publish, "drain": drain, "e2e": e2e, "soak": soak, "scrape": scrape}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpcache.bench")
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark to run")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--repetitions", type=int, default=3, help="repetitions; medians are reported (default 3; publish uses at least 5)")
    parser.add_argument("--seconds", type=float, default=60.0, help="soak: how long the producers run (default 60)")
    parser.add_argument("--rate", type=int, default=250_000, help="soak: events/s per producer (default 250000)")
    args = parser.parse_args(argv)
    module = BENCHMARKS[args.name]
    options = {"seconds": args.seconds, "rate": args.rate} if module is soak else {}
    result = module.run(repetitions=args.repetitions, progress=lambda msg: print(msg, file=sys.stderr), **options)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for key, value in result.items():
            print(f"{key:>32}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

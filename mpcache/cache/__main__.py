"""``python -m mpcache.cache --config PATH --worker I``: one cache process, as the supervisor starts it.
A start-up problem (bad configuration, missing or foreign shared memory) is one line and exit status 2; one met
once the supervisor is gone is told as the orphaning it comes from (status 0).
"""

from __future__ import annotations

import argparse
import resource
import sys

from mpcache.cache.process import CacheProcess, PublisherFactory
from mpcache.config import Config
from mpcache.errors import ConfigError, LayoutMismatchError
from mpcache.logs import configure_logging
from mpcache.parentage import SUPERVISOR_PID_HELP, supervisor_gone

DESCRIPTORS_WANTED = 1 << 16  # the Unix socket's and the LMCache front end's 1,024 connections each, and room


def raise_descriptor_limit() -> int:
    """Raise the soft open-files limit toward the hard one (never lower it): a default soft limit of 1,024 is
    fewer descriptors than the two transports may accept.  The limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = DESCRIPTORS_WANTED if hard == resource.RLIM_INFINITY else min(hard, DESCRIPTORS_WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        return wanted
    return soft


def main(argv: list[str] | None = None, publisher_factory: PublisherFactory | None = None) -> int:
    """Run one cache process; ``publisher_factory`` replaces the ring publisher (benchmarks only)."""
    parser = argparse.ArgumentParser(prog="mpcache.cache")
    parser.add_argument("--config", required=True, help="configuration file written by the supervisor")
    parser.add_argument("--worker", required=True, type=int, help="this cache process's index, 0..workers-1")
    parser.add_argument("--supervisor-pid", type=int, default=None, help=SUPERVISOR_PID_HELP)
    args = parser.parse_args(argv)
    try:
        config = Config.load(args.config)
    except (OSError, ValueError) as exc:  # ConfigError is a ValueError; so is bad JSON
        if supervisor_gone(args.supervisor_pid):  # the next run's start swept its runtime dir, config included
            log = configure_logging("cache", "", worker=args.worker)
            log.warning("cache.orphaned", parent_pid=args.supervisor_pid, start_error=f"--config {args.config}: {exc}")
            return 0
        print(f"mpcache.cache: --config {args.config}: {exc}", file=sys.stderr)
        return 2
    # stderr only: the supervisor forwards it, so the log file keeps a single writer
    log = configure_logging("cache", config.instance_id, config.log_level, worker=args.worker)
    raise_descriptor_limit()
    try:
        # the supervisor named in the config, not the parent found now: one killed before this line ran left
        # this process to another parent already, which a comparison with that parent would never notice
        process = CacheProcess(config, args.worker, job_ttl_s=config.prefetch_job_ttl_s,
                               parent_pid=config.supervisor_pid,
                               publisher_factory=publisher_factory, logger=log)
    except (ConfigError, LayoutMismatchError, OSError) as exc:
        if supervisor_gone(config.supervisor_pid):
            # the supervisor died while this process started, and the next run's start sweeps a dead run's
            # segments: what is missing is its doing, not a problem to report as one
            log.warning("cache.orphaned", parent_pid=config.supervisor_pid, start_error=str(exc))
            return 0
        log.error("cache.start_failed", error=str(exc))
        return 2
    process.run(install_signals=True, freeze=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Run LMCache 0.5.6's own load client (`lmcache bench server`) and judge what it printed.

`lmcache bench server` exits 0 even when lookups miss, stores fail or checksums
differ, so this wrapper reads its output and exits non-zero on any failure.
Standard library only; any python3 runs it.  The LMCache venv comes from
``--venv``, else ``$MPCACHE_TEST_LMCACHE_VENV``, else the default path of
``.ci/lmcache-env``::

    python3 tests/lmcache/run_bench_client.py --rpc-url tcp://127.0.0.1:5555 \
        [--requests 8] [--tp 2] [--mla]

For each sequence the bench sends a *cold* request (LOOKUP, STORE the missing
chunks, END_SESSION) and a *warm* one (LOOKUP, RETRIEVE into zeroed blocks,
END_SESSION), then compares per-chunk checksums of the stored and retrieved KV.
A run passes when every sequence shows: cold LOOKUP ``0/K``, ``STORE: stored``,
warm LOOKUP ``K/K``, ``RETRIEVE: retrieved``, ``CHECKSUM MATCH OK``; and the
JSON summary says ``total_requests == checksum_ok == --requests`` and
``checksum_fail == 0``.  The bench's token ids depend only on the sequence
number, so each run starts at a fresh random ``--start`` (a warm server would
otherwise turn the cold requests into hits).

The last stdout line is a JSON verdict; exit 0 = pass, 1 = fail, 2 = could
not run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

DEFAULT_VENV = Path.home() / ".cache/mpcache/lmcache-0.5.6-venv"
SEQ_LINE = re.compile(r"^\s*\[seq (\d+)(?:/(cold|warm))?\] (.*)$")


def build_command(args: argparse.Namespace, lmcache_bin: Path) -> list[str]:
    if args.default_shape:  # the bench's own KV shape and block count (32 layers, 8 KV heads of 128, fp16)
        spec = None
    elif args.mla:
        spec = f"(1,{args.num_blocks},16,1,{args.head_size or 576}):{args.dtype}:{args.layers}"
    else:
        spec = (
            f"(2,{args.num_blocks},16,{args.kv_heads},{args.head_size or 64}):"
            f"{args.dtype}:{args.layers}"
        )
    cmd = [
        str(lmcache_bin), "bench", "server",
        "--rpc-url", args.rpc_url,
        "--mode", "cpu",
        "--transfer-mode", "engine_driven",
        "--tp-size", str(args.tp),
        "--num-tokens", str(args.num_tokens),
        *(["--kvcache-shape-spec", spec, "--num-blocks", str(args.num_blocks)] if spec else []),
        "--block-size", "16",
        "--start", str(args.start),
        "--end", str(args.start + args.requests),
        "--interval", "0",
        "--format", "json",
    ]
    if args.mla:
        cmd.append("--use-mla")
    return cmd


def judge(stdout: str, requests: int) -> tuple[list[str], dict]:
    """Return (problems, facts) from the bench's stdout."""
    problems: list[str] = []
    per_seq: dict[int, dict[str, str]] = {}
    for line in stdout.splitlines():
        m = SEQ_LINE.match(line)
        if not m:
            continue
        seq, kind, text = int(m.group(1)), m.group(2) or "", m.group(3)
        entry = per_seq.setdefault(seq, {})
        if text.startswith("LOOKUP"):
            entry[f"{kind}_lookup"] = text
        elif text.startswith("STORE"):
            entry[f"{kind}_store"] = text
        elif text.startswith("RETRIEVE"):
            entry[f"{kind}_retrieve"] = text
        elif text.startswith("CHECKSUM MATCH") or text.startswith("CHECKSUM MISMATCH"):
            entry["checksum"] = text
        elif text.startswith("SKIP"):
            entry["skip"] = text
    if len(per_seq) != requests:
        problems.append(f"saw output for {len(per_seq)} sequences, expected {requests}")
    for seq, e in sorted(per_seq.items()):
        cold = re.match(r"LOOKUP: (\d+)/(\d+) chunks hit", e.get("cold_lookup", ""))
        warm = re.match(r"LOOKUP: (\d+)/(\d+) chunks hit", e.get("warm_lookup", ""))
        if "skip" in e:
            problems.append(f"seq {seq}: {e['skip']}")
            continue
        if not cold or cold.group(1) != "0":
            problems.append(f"seq {seq}: cold lookup not a full miss: {e.get('cold_lookup')!r}")
        if not e.get("cold_store", "").startswith("STORE: stored"):
            problems.append(f"seq {seq}: cold store: {e.get('cold_store')!r}")
        if not warm or warm.group(1) != warm.group(2):
            problems.append(f"seq {seq}: warm lookup not a full hit: {e.get('warm_lookup')!r}")
        if not e.get("warm_retrieve", "").startswith("RETRIEVE: retrieved"):
            problems.append(f"seq {seq}: warm retrieve: {e.get('warm_retrieve')!r}")
        if e.get("checksum") != "CHECKSUM MATCH OK":
            problems.append(f"seq {seq}: {e.get('checksum') or 'no checksum comparison'}")
    summary = None
    start = stdout.find("\n{")
    if start >= 0:
        end = stdout.rfind("\n}")
        try:
            summary = json.loads(stdout[start + 1 : end + 2])
        except ValueError:
            summary = None
    results = (summary or {}).get("metrics", {}).get("results")
    if not results:
        problems.append("no JSON result summary in the bench output")
    else:
        if results.get("total_requests") != requests:
            problems.append(f"summary total_requests={results.get('total_requests')}")
        if results.get("checksum_ok") != requests or results.get("checksum_fail") != 0:
            problems.append(
                f"summary checksum_ok={results.get('checksum_ok')} "
                f"checksum_fail={results.get('checksum_fail')}"
            )
    return problems, {"sequences": len(per_seq), "results": results}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rpc-url", required=True, help="e.g. tcp://127.0.0.1:5555")
    ap.add_argument("--venv", default=os.environ.get("MPCACHE_TEST_LMCACHE_VENV", str(DEFAULT_VENV)))
    ap.add_argument("--requests", type=int, default=8, help="sequences (each cold + warm)")
    ap.add_argument("--start", type=int, default=None, help="first sequence number (default random)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--mla", action="store_true")
    ap.add_argument("--default-shape", action="store_true",
                    help="the bench's default --kvcache-shape-spec and --num-blocks (a 32 MiB object per chunk)")
    ap.add_argument("--num-tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-size", type=int, default=None)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    if args.start is None:
        args.start = random.SystemRandom().randrange(1, 1 << 30)

    lmcache_bin = Path(args.venv) / "bin" / "lmcache"
    verdict: dict = {"ok": False, "rpc_url": args.rpc_url, "requests": args.requests,
                     "start": args.start, "tp": args.tp, "mla": args.mla}
    if not lmcache_bin.exists():
        verdict["reason"] = f"{lmcache_bin} missing: build the venv with .ci/lmcache-env"
        print(json.dumps(verdict))
        return 2
    cmd = build_command(args, lmcache_bin)
    verdict["command"] = cmd
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1",
               LMCACHE_DISABLE_BANNER="1")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        sys.stderr.write((exc.stdout or b"").decode(errors="replace") if isinstance(
            exc.stdout, bytes) else (exc.stdout or ""))
        verdict["reason"] = f"bench did not finish within {args.timeout}s"
        print(json.dumps(verdict))
        return 1
    # The bench's own progress lines, for a human reading the log.
    sys.stderr.write(proc.stdout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
    verdict["exit_code"] = proc.returncode
    problems, facts = judge(proc.stdout, args.requests)
    if proc.returncode != 0:
        problems.insert(0, f"bench exited {proc.returncode}")
    verdict.update(facts)
    verdict["problems"] = problems[:20]
    verdict["ok"] = not problems
    if problems:
        verdict["reason"] = problems[0]
    print(json.dumps(verdict))
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

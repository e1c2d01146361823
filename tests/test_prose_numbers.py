"""Numbers and names the documents quote agree with the code they describe: the C extensions setup.py builds,
the key cache's candidates and bound, the pump's sleep bounds and batch target, and every code name
docs/ARCHITECTURE.md cites."""

from __future__ import annotations

import inspect
import re
import subprocess
from pathlib import Path

import pytest
from support.extensions import setup_extensions
from support.performance_docs import NUMBER_WORDS

from mpcache.cache.lmcache import keycache
from mpcache.telemetry import pump

REPO = Path(__file__).resolve().parents[1]
# Names ARCHITECTURE.md cites that are not ours: the CUDA driver call it explains avoiding.
FOREIGN_NAMES = {"cudaLaunchHostFunc"}


def _text(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


def test_the_readme_and_development_guide_count_the_c_extensions_setup_py_builds():
    built = len(setup_extensions())
    claims = [re.search(r"compiles (\w+) small C extensions", _text(name)) for name in ("README.md",
                                                                                       "docs/DEVELOPMENT.md")]
    assert [NUMBER_WORDS[built]] * 2 == [claim.group(1) if claim else None for claim in claims]


def _duration(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"ms": 1e-3, "s": 1.0}[unit]


def test_the_architecture_gives_the_pumps_sleep_bounds_and_batch_target_of_the_code():
    defaults = inspect.signature(pump.Pump.run).parameters
    expected = (defaults["min_sleep_s"].default, pump.MAX_SLEEP_S, defaults["target_batch"].default)
    claims = re.findall(r"about (\d+) Ki records to\s+accumulate at the rate it just saw \((\d+ m?s) … (\d+ m?s)\)",
                        _text("docs/ARCHITECTURE.md"))
    assert len(claims) == 2
    assert all((_duration(low), _duration(high), int(target) * 1024) == expected for target, low, high in claims)


def test_every_code_name_the_architecture_cites_exists_in_the_repository():
    """A backticked snake_case or CamelCase name in docs/ARCHITECTURE.md is a word of some tracked source file."""
    names = {name.removesuffix("()").rsplit(".", 1)[-1]
             for name in re.findall(r"`([A-Za-z_][A-Za-z_0-9.]*(?:\(\))?)`", _text("docs/ARCHITECTURE.md"))}
    code_like = {name for name in names if "_" in name.strip("_") or re.search(r"[a-z][A-Z]", name)}
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.c", "*.pyi", "*.sh", "*.toml", "*.yaml", "*.yml"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    words = set()
    for path in tracked:
        words |= set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", (REPO / path).read_text(encoding="utf-8",
                                                                                    errors="replace")))
    assert sorted(code_like - words - FOREIGN_NAMES) == []


# --- every constant a document quotes, held to the code -------------------------------------------------------
# (document, pattern, the value from the code as the document writes it): every match of the pattern (a regular
# expression over the document with its whitespace runs made one space) must be there, at least once, and each
# of its groups (joined by " / ") must read the value.  Measured numbers (dated, with their command) are not here:
# they state what a run measured, not what the code is.

def _n(value: float) -> str:
    """A number as the prose writes it: thousands separated by commas, a whole float without its .0."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _assigned(path: str, name: str) -> int:
    """The integer ``name = N`` sets in a file that is not imported here (pyproject.toml's pytest-timeout bound,
    the root conftest's bound on a slow test)."""
    [value] = re.findall(rf"^{name} = (\d+)$", _text(path), re.MULTILINE)
    return int(value)


def _default(function, parameter: str):
    return inspect.signature(function).parameters[parameter].default


def _claims() -> list[tuple[str, str, str]]:
    from benchmarks import isolation as bench_isolation
    from benchmarks import lmcache as bench_lmcache
    from benchmarks import phase_ablation, policy_matrix, trace_gen
    from benchmarks import vllm as bench_vllm
    from mpcache import httpserver
    from mpcache.cache import blend, buffers, client_errors, l0, slabs, storage
    from mpcache.cache import process as cache_process
    from mpcache.cache.__main__ import DESCRIPTORS_WANTED
    from mpcache.cache.l2 import redis_adapter, trust
    from mpcache.cache.l2 import spec as l2_spec
    from mpcache.cache.lmcache import frontend, groups, inline, router, transfers, wire, zmtp
    from mpcache.cache.native import transport
    from mpcache.client import connection
    from mpcache.client.core import CacheClient
    from mpcache.config import derived, kinds
    from mpcache.config.model import MIN_MRC_HALF_LIFE_S, Config
    from mpcache.contract import protocol, tail_marks
    from mpcache.contract.events import MRC_HEAD_FIELDS, MRC_TAIL_MARK_FIELDS
    from mpcache.contract.keys import SAMPLE_MODULUS
    from mpcache.demo import run as demo_run
    from mpcache.eviction import verdicts
    from mpcache.shm import layout, publish
    from mpcache.supervisor import provision, restart, watch
    from mpcache.telemetry import buffered, bus, kvpub
    from mpcache.telemetry.metric_table import SPECIFIED
    from mpcache.telemetry.mrc import curves, history
    from mpcache.telemetry.subscribers import tracing
    from mpcache.telemetry.subscribers.metrics import l0_lifecycle, mrc
    from mpcache.tools import logtail, report

    l2_log_s = _n(_default(storage.StorageManager.__init__, "failure_log_interval_s"))
    ki, mib, gib = 2**10, 2**20, 2**30
    share = {2: "half", 3: "third", 4: "quarter"}[transfers.CONNECTION_SHARE]
    frame = f"{(wire.BYTES_PER_TOKEN * Config.lmcache_max_tokens + wire.FRAME_MARGIN_BYTES) // mib}"
    ring_mib = layout.event_segment_size(Config.ring_capacity_cells, Config.intern_capacity) / mib
    cells_mib = Config.ring_capacity_cells * layout.CELL_SIZE // mib
    return [
        # README.md
        ("README.md", r"metrics contract \((\d+) metrics", str(len(SPECIFIED))),
        ("README.md", r"moves the same (\d+) metrics", str(len(SPECIFIED))),
        ("README.md", r"bound to `(.+?):(\d+)` by default", f"{Config.prometheus_host} / {Config.prometheus_port}"),
        ("README.md", r"\| `--workers N` \| (\d+) \|", str(Config.workers)),
        ("README.md", r"\| `--l1-size` \| (\w+) \|", "256MiB" if Config.l1_size_bytes == 256 * mib else "?"),
        ("README.md", r"\| `--prometheus-host`, `--prometheus-port` \| ([\d.]+), (\d+) \|",
         f"{Config.prometheus_host} / {Config.prometheus_port}"),
        ("README.md", r"progress every (\d+) s", _n(demo_run.PROGRESS_INTERVAL_S)),
        ("README.md", r"`--kv-event-log-size (\d+)`, LMCache's size", str(Config.kv_event_log_size)),
        ("README.md", r"holds at most a (\w+) of it", share),
        ("README.md", r"more than (\d+) KV cache groups", str(groups.MAX_GROUPS)),
        ("README.md", r"each lookup's first (\d+) chunks", str(Config.mrc_exact_chunks)),
        ("README.md", r"at ([\d.]+)× … (\d+)× of today's capacity", f"{curves.GAUGE_RATIOS[0]:g} / "
                                                                     f"{curves.GAUGE_RATIOS[-1]:g}"),
        ("README.md", r"the whole curves \(([\d.]+)× … (\d+)×\)", f"{curves.POINT_RATIOS[0]:g} / "
                                                                 f"{curves.POINT_RATIOS[-1]:g}"),
        ("README.md", r"Pending spans are bounded and expire after (\d+) s", _n(tracing.DEFAULT_TTL_S)),
        # docs/ARCHITECTURE.md
        ("docs/ARCHITECTURE.md", r"runs of (\d+)-byte cells", str(layout.CELL_SIZE)),
        ("docs/ARCHITECTURE.md", r"\*\*Cell\*\* \((\d+) bytes\)", str(layout.CELL_SIZE)),
        ("docs/ARCHITECTURE.md", r"every (\d+) s, and as soon as a buffer holds (\d+) Ki samples",
         f"{_n(bus.TELEMETRY_FLUSH_INTERVAL_S)} / {buffered.MAX_HELD_SAMPLES // ki}"),
        ("docs/ARCHITECTURE.md", r"backoff doubling from ([\d.]+) s up to (\d+) s",
         f"{_n(restart.TELEMETRY_POLICY.backoff_initial_s)} / {_n(restart.TELEMETRY_POLICY.backoff_max_s)}"),
        ("docs/ARCHITECTURE.md", r"restarted with backoff \(([\d.]+) s … (\d+) s\); one that exits (\d+) times "
                                 r"within (\d+) s",
         " / ".join(_n(v) for v in (restart.CACHE_POLICY.backoff_initial_s, restart.CACHE_POLICY.backoff_max_s,
                                    restart.CACHE_POLICY.give_up_after, restart.CACHE_POLICY.crash_window_s))),
        ("docs/ARCHITECTURE.md", r"the supervisor looking every ([\d.]+) s", _n(watch.WATCH_INTERVAL_S)),
        ("docs/ARCHITECTURE.md", r"a word of the gauge board it advances every ([\d.]+) s",
         _n(_default(cache_process.CacheProcess.__init__, "heartbeat_interval_s"))),
        ("docs/ARCHITECTURE.md", r"event ring \(`--ring-cells` × (\d+) bytes, ([\d.]+) MiB by default\)",
         f"{layout.CELL_SIZE} / {round(ring_mib * 2) / 2:g}"),
        ("docs/ARCHITECTURE.md", r"\(2 × `--telemetry-state-size`, (\d+) MiB by default\) — and a (\d+) MiB margin",
         f"{2 * Config.telemetry_state_bytes // mib} / {provision.SHM_MARGIN_BYTES // mib}"),
        ("docs/ARCHITECTURE.md", r"more than (\d+) with one frame close the connection",
         str(transport.MAX_FDS_PER_FRAME)),
        ("docs/ARCHITECTURE.md", r"replies pile up \((\d+) MiB unsent\)", str(transport.OUTBUF_PAUSE_BYTES // mib)),
        ("docs/ARCHITECTURE.md", r"accepted up to (\d+) a pass", str(router.ACCEPTS_PER_WAKE)),
        ("docs/ARCHITECTURE.md", r"at most ([\d,]+) connections \(the cache process raises its soft open-files "
                                 r"limit toward the hard one, up to ([\d,]+), at start, so this and the Unix "
                                 r"socket's ([\d,]+) fit",
         f"{router.MAX_CONNECTIONS:,} / {DESCRIPTORS_WANTED:,} / {transport.MAX_CONNECTIONS:,}"),
        ("docs/ARCHITECTURE.md", r"a handshake finished within (\d+) s; a frame at most the cap below, a message at "
                                 r"most (\d+) frames",
         f"{_n(router.HANDSHAKE_TIMEOUT_S)} / {frontend.MAX_FRAMES}"),
        ("docs/ARCHITECTURE.md", r"a command at most (\d+) KiB", str(zmtp.MAX_COMMAND_BYTES // ki)),
        ("docs/ARCHITECTURE.md", r"held up to (\d+) MiB, then it is dropped", str(router.MAX_UNSENT_BYTES // mib)),
        ("docs/ARCHITECTURE.md", r"at most LMCache's own (\d+) GiB", str(inline.MAX_TOTAL_BYTES // gib)),
        ("docs/ARCHITECTURE.md", r"at most (\d+) commands a call", str(router.COMMANDS_PER_CALL)),
        ("docs/ARCHITECTURE.md", r"at most (\d+) arguments, and a (\d+) ms budget",
         f"{frontend.MAX_ARGUMENTS} / {_n(frontend.PASS_BUDGET_S * 1000)}"),
        ("docs/ARCHITECTURE.md", r"connection holds at most a (\w+) of L1's bytes", share),
        ("docs/ARCHITECTURE.md", r"\(([\d,]+) tensors, (\d+) groups, rank (\d+), (\d+) GiB a tensor, (\d+) GiB in "
                                 r"all\)",
         f"{inline.MAX_TENSORS:,} / {inline.MAX_GROUPS} / {inline.MAX_RANK} / {inline.MAX_TENSOR_BYTES // gib} / "
         f"{inline.MAX_TOTAL_BYTES // gib}"),
        ("docs/ARCHITECTURE.md", r"Client errors are logged at most (\d+) lines a second",
         str(_default(client_errors.RateLimit.__init__, "per_second"))),
        ("docs/ARCHITECTURE.md", r"at most (\d+) MiB and a (\d+)th of the pool",
         f"{slabs.MAX_SLAB_BYTES // mib} / {slabs.MIN_SLABS}"),
        ("docs/ARCHITECTURE.md", r"At most (\d+) jobs and (\d+) sessions exist",
         f"{_default(cache_process.CacheProcess.__init__, 'max_jobs')} / "
         f"{_default(cache_process.CacheProcess.__init__, 'max_sessions')}"),
        ("docs/ARCHITECTURE.md", r"at most one line per adapter and kind every (\d+) s",
         l2_log_s),
        ("docs/ARCHITECTURE.md", r"`shards` \(default (\d+) on a server, (\d+) on a cluster",
         f"{l2_spec.SHARDS} / {l2_spec.CLUSTER_SHARDS}"),
        ("docs/ARCHITECTURE.md", r"that shard is taken as down for (\d+) s",
         _n(_default(redis_adapter.RedisL2Adapter.__init__, "down_for_s"))),
        ("docs/ARCHITECTURE.md", r"`connect_timeout_s` \((\d+) s by default\)",
         _n(_default(redis_adapter.RedisL2Adapter.__init__, "connect_timeout_s"))),
        ("docs/ARCHITECTURE.md", r"no access for group or others, at least (\d+) bytes", str(trust.MIN_SECRET_BYTES)),
        ("docs/ARCHITECTURE.md", r"for one event \((\d+) blocks", str(l0.MAX_BLOCKS_PER_EVENT)),
        ("docs/ARCHITECTURE.md", r"waits for them \(at most ([\d.]+) s", _n(pump.CATCH_UP_WAIT_S)),
        ("docs/ARCHITECTURE.md", r"expires after (\d+) s idle", _n(tracing.DEFAULT_TTL_S)),
        ("docs/ARCHITECTURE.md", r"`chunk_hash mod ([\d_]+) <", f"{SAMPLE_MODULUS:_}"),
        ("docs/ARCHITECTURE.md", r"taken at most once a (\w+)", {60.0: "minute"}.get(mrc.HISTORY_EVERY_S, "?")),
        ("docs/ARCHITECTURE.md", r"layout version u32 \((\d+)\), records u32 \((\d+)\)",
         f"{layout.STATE_LAYOUT_VERSION} / {layout.STATE_RECORDS}"),
        ("docs/ARCHITECTURE.md", r"gauge layout version u32 \((\d+)\)", str(layout.GAUGE_LAYOUT_VERSION)),
        ("docs/ARCHITECTURE.md", r"cache process of (\d+) \+ (\d+) × (\d+) i64 words",
         f"{layout.GAUGE_FIXED_WORDS} / {layout.GAUGE_ADAPTER_WORDS} / {layout.MAX_ADAPTERS}"),
        ("docs/ARCHITECTURE.md", r"truncation \(polling every (\d+) ms\)", _n(logtail.POLL_INTERVAL_S * 1000)),
        ("docs/ARCHITECTURE.md", r"records of `--telemetry-state-size` bytes each \((\d+) MiB by default\)",
         str(Config.telemetry_state_bytes // mib)),
        ("docs/ARCHITECTURE.md", r"in the gauge board \(word (\d+) of its slot\)", str(layout.G_STATE)),
        ("docs/ARCHITECTURE.md", r"`used_bytes` \(gauge word (\d+),", str(layout.G_L1_USED)),
        ("docs/ARCHITECTURE.md", r"`fragmentation_bytes` \(word (\d+),", str(layout.G_L1_FRAGMENTATION)),
        ("docs/ARCHITECTURE.md", r"i64 words at byte (\d+): telemetry's restarts, written by the supervisor; (\d+): "
                                 r"telemetry's heartbeat ns and (\d+): its pid",
         f"{layout.GAUGE_OFF_TELEMETRY_RESTARTS} / {layout.GAUGE_OFF_TELEMETRY_HEARTBEAT} / "
         f"{layout.GAUGE_OFF_TELEMETRY_PID}"),
        ("docs/ARCHITECTURE.md", r"(\d+) objects whose copy L1's pool's loss voided, (\d+) L1's admission chance "
                                 r"times its capacity \(bytes\), (\d+) chunks L1's eviction order refused, then per "
                                 r"adapter \*a\*: (\d+)\+4a bytes held, (\d+)\+4a in-flight store tasks, (\d+)\+4a "
                                 r"in-flight load tasks, (\d+)\+4a in-flight load bytes",
         " / ".join(str(word) for word in (layout.G_L1_LOST_COPIES, layout.G_L1_ADMITTING, layout.G_L1_REFUSED, *(
             layout.GAUGE_FIXED_WORDS + offset for offset in (
             layout.G_L2_USAGE, layout.G_L2_INFLIGHT_STORES, layout.G_L2_INFLIGHT_LOADS,
             layout.G_L2_INFLIGHT_LOAD_BYTES))))),
        # docs/SECURITY.md
        ("docs/SECURITY.md", r"A frame is at most `(\d+) × --lmcache-max-tokens \+ (\d+) MiB` \(default (\d+) Mi "
                             r"tokens: (\d+) MiB",
         f"{wire.BYTES_PER_TOKEN} / {wire.FRAME_MARGIN_BYTES // mib} / {Config.lmcache_max_tokens // mib} / {frame}"),
        ("docs/SECURITY.md", r"a message at most (\d+) frames", str(frontend.MAX_FRAMES)),
        ("docs/SECURITY.md", r"a connection at most (\d+) MiB of", str(router.MAX_UNSENT_BYTES // mib)),
        ("docs/SECURITY.md", r"capped at LMCache's own (\d+) GiB, plus (\d+) MiB of metadata",
         f"{inline.MAX_TOTAL_BYTES // gib} / {inline.METADATA_BYTES_PER_TENSOR * inline.MAX_TENSORS // mib}"),
        ("docs/SECURITY.md", r"at most ([\d,]+) connections, each finishing its handshake within (\d+) s",
         f"{router.MAX_CONNECTIONS:,} / {_n(router.HANDSHAKE_TIMEOUT_S)}"),
        ("docs/SECURITY.md", r"no map over (\d+) entries, in a frame over (\d+) KiB", f"{wire.MAX_MAP_ENTRIES} / "
                                                                                f"{wire.SMALL_FRAME_BYTES // ki}"),
        ("docs/SECURITY.md", r"carries at most (\d+) arguments", str(frontend.MAX_ARGUMENTS)),
        ("docs/SECURITY.md", r"for at most (\d+) ms per pass", _n(frontend.PASS_BUDGET_S * 1000)),
        ("docs/SECURITY.md", r"connection holds at most a (\w+) of L1's bytes", share),
        ("docs/SECURITY.md", r"The Unix socket takes at most ([\d,]+) connections", f"{transport.MAX_CONNECTIONS:,}"),
        ("docs/SECURITY.md", r"at most (\d+) are accepted a pass", str(router.ACCEPTS_PER_WAKE)),
        ("docs/SECURITY.md", r"(\d+) a second in all", str(_default(client_errors.RateLimit.__init__,
                                                                   "per_second"))),
        ("docs/SECURITY.md", r"registers at most (\d+) buffers of (\d+) TiB together, and all connections of a "
                             r"cache process at most ([\d,]+) buffers of (\d+) TiB together",
         f"{buffers.MAX_BUFFERS_PER_PEER} / {buffers.MAX_PEER_BYTES // 2**40} / {buffers.MAX_BUFFERS:,} / "
         f"{buffers.MAX_BYTES // 2**40}"),
        # docs/CLIENT.md
        ("docs/CLIENT.md", r"backoff \((\d+) ms doubling to (\d+) s\) for up to `reconnect_timeout_s` \(default "
                           r"(\d+) s\)",
         f"{_n(connection.RECONNECT_FIRST_PAUSE_S * 1000)} / {_n(connection.RECONNECT_MAX_PAUSE_S)} / "
         f"{_n(_default(CacheClient.__init__, 'reconnect_timeout_s'))}"),
        ("docs/CLIENT.md", r"over (\d+) bytes gets a one-line error reply", str(protocol.NAME_MAX_BYTES)),
        # docs/MRC.md
        ("docs/MRC.md", r"ratios ([\d., ]+) \|", ", ".join(f"{ratio:g}" for ratio in curves.GAUGE_RATIOS)),
        ("docs/MRC.md", r"every curve as JSON, (\d+) points from ([\d.]+)× to (\d+)×",
         f"{len(curves.POINT_RATIOS)} / {curves.POINT_RATIOS[0]:g} / {curves.POINT_RATIOS[-1]:g}"),
        ("docs/MRC.md", r"At most (\d+) tenants get their own curve", str(curves.MAX_TENANT_CURVES)),
        ("docs/MRC.md", r"each history tracks `--mrc-max-keys` / N keys \(at least (\d+)",
         str(curves.MIN_KEYS_PER_PROCESS)),
        ("docs/MRC.md", r"more than (\d+) × `--mrc-max-keys` keys were forgotten", str(history.FORGOTTEN_PER_KEY)),
        ("docs/MRC.md", r"the last (\d+) × `--mrc-max-keys` of them", str(history.FORGOTTEN_PER_KEY)),
        ("docs/MRC.md", r"chunks \(default (\d+), at most (\d+)\)",
         f"{Config.mrc_exact_chunks} / {len(MRC_HEAD_FIELDS)}"),
        ("docs/MRC.md", r"They travel as (\d+) fixed fields", str(len(MRC_HEAD_FIELDS))),
        ("docs/MRC.md", r"carries the tail's marks in (\d+) fixed fields \(`mpcache/contract/tail_marks\.py`; the "
                        r"record stays within the compiled publisher's (\d+) fields\): (\d+) bits of the key of (\d+) "
                        r"of its chunks from its start \(every one of the first (\d+), then (\d+) more, each about ⅛ "
                        r"further on than the one before, the last at chunk (\d+) of the tail\) and (\d+) bits of "
                        r"each of its last (\d+) chunks",
         f"{len(MRC_TAIL_MARK_FIELDS)} / "
         f"{layout.HEAD_FIELD_SLOTS + publish.PLAIN_FIELD_CELLS * layout.SLOTS_PER_CELL} / {tail_marks.MARK_BITS} / "
         f"{len(tail_marks.FROM_START)} / {tail_marks.DENSE} / {tail_marks.GEOMETRIC} / {tail_marks.FROM_START[-1]} / "
         f"{tail_marks.END_MARK_BITS} / {tail_marks.END_MARKS}"),
        ("docs/MRC.md", r"so two tails that part there and differ in length by (\d+) chunks or more read as sharing "
                        r"the shorter whole \(the most they can read too many is the gap between two marks: about (⅛) "
                        r"of the shorter tail, and all of it past chunk (\d+)\)",
         f"{tail_marks.END_MARKS} / {({8: '⅛'}.get(round(1 / (tail_marks.GROWTH - 1)), ''))} / "
         f"{tail_marks.FROM_START[-1]}"),
        ("docs/MRC.md", r"objects in up to (\d+) segments of at least one object and 1/(\d+) of the smallest "
                        r"miniature's capacity \(so a miniature holds at most (\d+) segments per (⅛) of L1 it is; at "
                        r"most (\d+) per head key",
         f"{history.SEGMENT_PIECES} / {history.SEGMENT_MIN_SHARE} / {history.SEGMENT_MIN_SHARE} / "
         f"{({0.125: '⅛'}.get(curves.MINI_RATIOS[0], ''))} / {history.SEGMENTS_PER_HEAD}"),
        ("docs/MRC.md", r"one in four at (\d+) bits", str(tail_marks.MARK_BITS)),
        ("docs/MRC.md", r"then \d+ more, each about (⅛) further on",
         {8: "⅛"}.get(round(1 / (tail_marks.GROWTH - 1)), "")),
        ("docs/MRC.md", r"the last chunks' (\d+)-bit marks part them", str(tail_marks.END_MARK_BITS)),
        ("docs/MRC.md", r"half of `--mrc-max-keys` \(default (\d+)\) keys", str(Config.mrc_max_keys)),
        ("docs/MRC.md", r"`chunk_hash mod ([\d_]+) <", f"{SAMPLE_MODULUS:_}"),
        ("docs/MRC.md", r"stack than the largest capacity of any curve \((\d+)× the largest tier\)",
         f"{curves.POINT_RATIOS[-1]:g}"),
        # docs/L2.md
        ("docs/L2.md", r"at most once per (\d+) s per tier", l2_log_s),
        ("docs/L2.md", r"least (\d+) bytes \(trailing whitespace", str(trust.MIN_SECRET_BYTES)),
        ("docs/L2.md", r"\.mpcache-l2-secret` \((\d+) random bytes", str(trust.KEY_BYTES)),
        ("docs/L2.md", r"\(default (\d+) s each\)", _n(_default(redis_adapter.RedisL2Adapter.__init__,
                                                                 "socket_timeout_s"))),
        ("docs/L2.md", r"taken as down for (\d+) s", _n(_default(redis_adapter.RedisL2Adapter.__init__, "down_for_s"))),
        ("docs/L2.md", r"\(index shards, 1\.\.(\d+); default (\d+), (\d+) with cluster\)",
         f"{l2_spec.MAX_SHARDS} / {l2_spec.SHARDS} / {l2_spec.CLUSTER_SHARDS}"),
        # docs/DEPLOYMENT.md
        ("docs/DEPLOYMENT.md", r"`--ring-cells` × (\d+) bytes, default (\d+)MiB",
         f"{layout.CELL_SIZE} / {cells_mib}"),
        ("docs/DEPLOYMENT.md", r"ring\) \+ telemetry state \+ (\d+) MiB`", str(provision.SHM_MARGIN_BYTES // mib)),
        # docs/DEVELOPMENT.md
        ("docs/DEVELOPMENT.md", r"`metrics\.tsv`: the (\d+) metrics'", str(len(SPECIFIED))),
        ("docs/DEVELOPMENT.md", r"one that runs past (\d+) s \((\d+) s for a `slow` one",
         f"{_assigned('pyproject.toml', 'timeout')} / {_assigned('tests/conftest.py', 'SLOW_TIMEOUT_S')}"),
        # docs/BENCHMARKS.md (the benchmarks' own defaults)
        ("docs/BENCHMARKS.md", r"repetition \((\d+) by default, `--repetitions`\)", str(bench_vllm.REPETITIONS)),
        ("docs/BENCHMARKS.md", r"`--l1-gb` sets both caches' L1 \(default ([\d.]+) GiB\)", f"{bench_vllm.L1_GB:g}"),
        ("docs/BENCHMARKS.md", r"they use at most (\d+) % of a core in (\d+) windows of ([\d.]+) s in a row, "
                               r"waited for up to (\d+) s",
         f"{bench_vllm.QUIET_SHARE * 100:g} / {bench_vllm.QUIET_WINDOWS} / {bench_vllm.QUIET_WINDOW_S:g} / "
         f"{bench_vllm.QUIET_TIMEOUT_S:g}"),
        ("docs/BENCHMARKS.md", r"server's L1 \(default ([\d.]+) GiB", f"{bench_lmcache.L1_GB:g}"),
        ("docs/BENCHMARKS.md", r"\(`--l1-gb`, default (\d+) GiB\)", f"{bench_isolation.L1_GB:g}"),
        ("docs/BENCHMARKS.md", r"\(`--warmup`, default (\d+) s, uncounted\), an idle window \((\d+) s, counted, no "
                               r"requests\) and the measured window \(`--seconds`, default (\d+)\)",
         f"{bench_isolation.WARMUP_S:g} / {bench_isolation.IDLE_S:g} / {bench_isolation.SECONDS:g}"),
        ("docs/BENCHMARKS.md", r"every `trace_gen` kind \(([\d,]+) requests, seed (\d+); `--seed` draws held-out "
                               r"ones\) and each `--trace`, whole "
                               r"and its first ([\d,]+) requests",
         f"{policy_matrix.REQUESTS:,} / {policy_matrix.SEED} / {policy_matrix.FIRST:,}"),
        ("docs/BENCHMARKS.md", r"COUNT is 1 to ([\d,]+), `--seed` 0 or", f"{trace_gen.MAX_COUNT:,}"),
        ("docs/BENCHMARKS.md", r"the same replay \(([\d,]+) requests and their first ([\d,]+), seeds (\d+) to (\d+) by",
         f"{phase_ablation.REQUESTS:,} / {phase_ablation.FIRST:,} / {phase_ablation.SEEDS[0]} / "
         f"{phase_ablation.SEEDS[1]}"),
        ("docs/BENCHMARKS.md", r"the best of its (\d+) periods k\); it flags an order more than ([\d.]+) below",
         f"{len(policy_matrix.LMCACHE_PERIODS)} / {policy_matrix.TOLERANCE:g}"),
        ("docs/BENCHMARKS.md", r"once the other phase's lead has grown more than (\d+) standard deviations from its "
                               r"lowest", f"{phase_ablation.DUEL_SIGMAS:g}"),
        # CHANGELOG.md (the bounds the Unreleased fixes name)
        ("CHANGELOG.md", r"answer a request head over (\d+) bytes with 431 \(reading on past it, up to (\d+) MiB",
         f"{httpserver.MAX_REQUEST_BYTES} / {httpserver.DISCARD_BYTES >> 20}"),
        ("CHANGELOG.md", r"is refused outside \(0, ([\d]+)\] s", f"{report.MAX_TIMEOUT_S:g}"),
        ("CHANGELOG.md", r"COUNT is 1 to ([\d,]+) and `--seed` 0 or more", f"{trace_gen.MAX_COUNT:,}"),
        ("CHANGELOG.md", r"`--mrc-half-life` is 0 \(off\) or at least (\d+) s", f"{MIN_MRC_HALF_LIFE_S:g}"),
        ("CHANGELOG.md", r"refused setting's value is quoted cut to (\d+) characters", str(kinds.SHOWN_CHARACTERS)),
        ("CHANGELOG.md", r"and copied and scanned them at each store: a name now keeps its newest (\d+) parts",
         str(verdicts.STORE_PARTS)),
        ("CHANGELOG.md", r"charged nothing for a layout's ranks \(up to ([\d,]+) per TP size a client names\): one "
                         r"request's lookups under every TP size kept gigabytes within its (\d+) MiB bound",
         f"{wire.MAX_WORLD_SIZE:,} / {keycache.MAX_BYTES >> 20}"),
        ("CHANGELOG.md", r"An object under ([\d,]+) bytes takes ([\d,]+) bytes of L1",
         f"{slabs.MIN_SPOT_BYTES:,} / {slabs.MIN_SPOT_BYTES:,}"),
        ("CHANGELOG.md", r"taken as ended, oldest first, past (\d+) ownerships per block tracked, and one block "
                         r"keeps at most (\d+) owners",
         f"{l0_lifecycle.OWNERS_PER_BLOCK} / {l0_lifecycle.MAX_BLOCK_OWNERS}"),
        ("CHANGELOG.md", r"at most ([\d,]+) are kept over all sessions now", f"{blend.MAX_HITS_KEPT:,}"),
        ("CHANGELOG.md", r"replay buffer is held to (\d+) MiB of payload besides its ([\d,]+) messages",
         f"{kvpub.BUFFER_BYTES >> 20} / {kvpub.BUFFER_STEPS:,}"),
        ("CHANGELOG.md", r"so a log line cannot send a terminal escape or forge another line; a line is kept to "
                         r"(\d+) MiB", str(logtail.MAX_LINE_BYTES >> 20)),
        ("docs/ARCHITECTURE.md", r"a record nested more than (\d+) deep is printed as its line",
         str(logtail.MAX_FIELD_DEPTH)),
        ("docs/ARCHITECTURE.md", r"or is longer than it keeps \((\d+) MiB\), is skipped",
         str(logtail.MAX_LINE_BYTES >> 20)),
        # docs/CONFIGURATION.md (its prose; the table is generated)
        ("docs/CONFIGURATION.md", r"a smaller `--l1-size` \((\d+MiB), (\d+MiB) with `--l2`\), `--prefetch-job-ttl "
                                  r"(\d+)` and `--metrics-sample-rate ([\d.]+)`",
         f"{derived.DEMO_L1_SIZE // mib}MiB / {derived.DEMO_L1_SIZE_WITH_L2 // mib}MiB / "
         f"{_n(derived.DEMO_PREFETCH_JOB_TTL_S)} / {derived.DEMO_METRICS_SAMPLE_RATE:g}"),
    ]


CLAIMS = _claims()


@pytest.mark.parametrize(("document", "pattern", "expected"), CLAIMS,
                         ids=[f"{document}:{pattern[:40]}" for document, pattern, _ in CLAIMS])
def test_each_constant_a_document_quotes_is_the_codes(document, pattern, expected):
    text = " ".join(_text(document).split())
    found = [" / ".join(groups) if isinstance(groups, tuple) else groups for groups in re.findall(pattern, text)]
    assert found, f"{document} no longer says {pattern!r}: update the claim with the sentence"
    assert [expected] * len(found) == found


# The documents a flag's default may be quoted in: not the history, not the generated pages.
PROSE = ("README.md", "docs/ARCHITECTURE.md", "docs/CLIENT.md", "docs/CONFIGURATION.md", "docs/DEPLOYMENT.md",
         "docs/DEVELOPMENT.md", "docs/EXTENDING.md", "docs/L2.md", "docs/MRC.md", "docs/SECURITY.md")


def _quoted_defaults() -> list[tuple[str, str, str, str]]:
    """(document, flag, the default it quotes, the declared default) for every "`--flag` ... default N" in the
    prose, N a number or size within the flag's clause."""
    from mpcache.config.model import SETTINGS
    from mpcache.config.reference import BEGIN, END
    from mpcache.config.setting import shown

    quoted = []
    for document in PROSE:
        text = _text(document)
        if BEGIN in text:
            text = text[:text.index(BEGIN)] + text[text.index(END):]
        text = " ".join(text.split())
        for item in SETTINGS:
            pattern = rf"`--{item.name}(?: [A-Z]+)?`[^.;`×]{{0,40}}?default:? ([0-9][0-9.,]*(?: ?[KMG]iB)?)"
            quoted += [(document, item.flag, value, shown(item.kind, item.default))
                       for value in re.findall(pattern, text)]
    return quoted


def test_every_flag_default_the_prose_quotes_is_the_declared_one():
    """A default quoted beside its flag (`--idle-timeout` seconds, default 600) is the Config field's."""
    quoted = _quoted_defaults()
    assert len(quoted) >= 10  # the pattern still finds the prose's quotes
    assert [] == [row for row in quoted if row[2].replace(" ", "").replace(",", "") != row[3]]


def test_every_default_the_help_states_is_rendered_from_the_declaration():
    """--help says "default N" only where N is the declared default (``{default}`` in the declaration)."""
    from mpcache.config.model import SETTINGS
    from mpcache.config.setting import shown

    stated = [(item.flag, value, shown(item.kind, item.default)) for item in SETTINGS
              for value in re.findall(r"default ([0-9][0-9.]*(?:[KMG]iB)?)\b", item.help)]
    assert len(stated) >= 20
    assert [] == [row for row in stated if row[1] != row[2]]


def test_the_help_and_metrics_page_quote_the_sdks_cardinality_limit_and_the_declared_sample_rate():
    from opentelemetry.sdk.metrics._internal._view_instrument_match import _DEFAULT_CARDINALITY_LIMIT

    from mpcache.config.model import SETTINGS, Config

    [series_cap] = [item for item in SETTINGS if item.field == "metric_series_cap"]
    assert re.findall(r"below the OpenTelemetry SDK's (\d+)", series_cap.help) == [str(_DEFAULT_CARDINALITY_LIMIT)]
    assert re.findall(r"`--metrics-sample-rate`, default ([\d.]+) %", " ".join(_text("docs/METRICS.md").split())) == [
        f"{Config.metrics_sample_rate * 100:g}"]


def test_the_architectures_ring_header_table_is_the_layouts():
    """docs/ARCHITECTURE.md draws the event segment's header: a row at every offset layout.py names, and no other;
    its magic, cell size and intern entries as layout.py has them."""
    from mpcache.shm import layout

    text = _text("docs/ARCHITECTURE.md")
    start = text.index(f"| 0 | 8 | magic `{layout.RING_MAGIC.decode()}` |")
    table = text[start:text.index("The producer's, the tail's", start)]
    offsets = [int(offset) for offset in re.findall(r"^\| (\d+) \|", table, re.MULTILINE)]
    named = {value for name, value in vars(layout).items() if name.startswith("OFF_")}
    assert sorted(named | {layout.HEADER_SIZE}) == offsets
    assert f"| {layout.OFF_CELL_SIZE} | 4 | cell size (u32, {layout.CELL_SIZE}) |" in table
    assert (f"| {layout.HEADER_SIZE} | … | intern entries, {layout.INTERN_ENTRY_SIZE} bytes each: u32 length, 4 pad "
            f"bytes, up to {layout.INTERN_MAX_BYTES} bytes of UTF-8 |") in table


def test_the_architectures_l2_record_and_cell_tables_are_the_codes():
    """The chunk record's table: each field's offset and size as the record's struct packs them, its version
    and MAC size; a cell's slots and a text cell's bytes as layout.py has them."""
    import struct

    from mpcache.cache.l2 import base
    from mpcache.shm import layout

    text = " ".join(_text("docs/ARCHITECTURE.md").split())
    # magic, version, model_len, salt_len, the reserved pad, chunk_hash, payload_len
    codes = re.findall(r"\d*[a-wyzA-Z]|x+", base._FIXED.format.lstrip("<"))
    sizes = {struct.calcsize("<" + "".join(codes[:index])): struct.calcsize("<" + code)
             for index, code in enumerate(codes)}
    assert sizes == {
        int(offset): int(size) for offset, size in re.findall(r"\| (\d+) \| (\d+) \| (?:magic `MPL2`|version|model_len|"
                                                               r"salt_len|reserved|chunk_hash|payload_len)", text)}
    mac = base.HEADER_BYTES - base._FIXED.size
    assert f"| {base._FIXED.size} | {mac} | MAC: blake2b-{mac * 8} keyed" in text
    assert f"| {base.HEADER_BYTES} | M+S | model_name, then cache_salt |" in text
    assert f"| 4 | 2 | version ({base.RECORD_VERSION}; version {base.RECORD_VERSION - 1} records" in text
    assert base.RECORD_MAGIC.decode() == "MPL2"
    words = {3: "three", 6: "six", 7: "seven"}
    assert f"then {words[layout.SLOTS_PER_CELL]} 8-byte slots" in text
    assert f"then the first {words[layout.HEAD_FIELD_SLOTS]} fixed fields" in text
    assert (f"byte {layout.CELL_OFF_SLOTS}: text field number, byte {layout.TEXT_OFF_LENGTH}: bytes used "
            f"(≤ {layout.TEXT_BYTES_PER_CELL}), bytes {layout.TEXT_OFF_DATA}–{layout.CELL_SIZE - 1}: UTF-8") in text
    assert f"inline* in slots {layout.INLINE_SALT_SLOT}–{layout.SLOTS_PER_CELL - 1}" in text
    kinds = {name: f"{'u' if layout.CELL_DTYPE[name].kind == 'u' else 'i'}{layout.CELL_DTYPE[name].itemsize * 8}"
             for name in ("seq", "kind", "etype", "index")}
    assert re.findall(r"`(seq|kind|etype|index)` ([ui]\d+)", text[text.index("**Cell**"):]) [:4] == list(kinds.items())
    extending = " ".join(_text("docs/EXTENDING.md").split())
    assert f"an unused id below {2 ** (8 * layout.CELL_DTYPE['etype'].itemsize)}" in extending


def test_the_readmes_numbers_follow_from_its_own_commands_and_the_chunk_size():
    """The demo's run time the quick start states is its command's; the mq_timeout the mistakes table quotes is
    the configuration block's; the tokens vLLM loads of its repeated prompt are the prompt's whole chunks of
    --chunk-size's default."""
    from mpcache.config.model import Config

    text = " ".join(_text("README.md").split())
    assert re.findall(r"--demo --duration (\d+)", text) == re.findall(r"load generator for (\d+) s", text) != []
    [configured] = re.findall(r'"lmcache\.mp\.mq_timeout": (\d+)', text)
    assert [configured] == re.findall(r"so `mq_timeout` is (\d+) s", text)
    assert set(re.findall(r"within (\d+)\.0s", text)) == {configured}
    [(prompt, loaded, chunk)] = re.findall(r"a ([\d,]+)-token prompt comes, vLLM takes ([\d,]+) of its tokens \(its "
                                           r"whole (\d+)-token chunks\)", text)
    prompt_tokens, chunk_tokens = int(prompt.replace(",", "")), Config.chunk_size_tokens
    assert (int(chunk), int(loaded.replace(",", ""))) == (chunk_tokens, prompt_tokens // chunk_tokens * chunk_tokens)


def test_the_key_caches_candidates_and_bound_are_the_codes_where_the_docs_give_them():
    """ARCHITECTURE.md and SECURITY.md give how many token lists the scanner is handed and the one bound."""
    for name in ("docs/ARCHITECTURE.md", "docs/SECURITY.md"):
        text = " ".join(_text(name).split())
        assert re.findall(r"the (\w+) most recently used token lists", text) == [NUMBER_WORDS[keycache.CANDIDATES]]
        assert re.findall(r"(\d+) MiB[,.]? (?:charged|in all)", text) == [str(keycache.MAX_BYTES >> 20)]

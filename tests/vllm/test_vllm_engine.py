"""A real vLLM engine (``vllm.LLM``, CPU build, LMCache 0.5.6's ``LMCacheMPConnector``) against a real
``bin/start-cache``, configured exactly as README's "Use it from vLLM" says (the test reads the service's flags and
the ``kv_transfer_config`` from that block).

What is checked comes from vLLM's own outputs and counters (``vllm:prompt_tokens_by_source``, the request's
``num_cached_tokens``, the generated tokens) and from mpcache's /metrics, each against values known without the
code under test: the prompt's length and the chunk size, and the tokens a connector-less engine generates for the
same prompt.  vLLM's prefix cache is off, so every prompt token is either computed or loaded from mpcache.
"""

from __future__ import annotations

import json
import random
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from support.ports import free_ports
from support.service import Scrape, Service
from support.waiting import wait_for

from benchmarks.vllm_engine import Engine, wait_all_ready
from mpcache.client import CacheClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
CHUNK = 256  # tokens per chunk: start-cache's default --chunk-size, which LMCache's connector asks for
VOCAB = 1024  # the tiny model's (engine.py SIZES["tiny"])
MAX_TOKENS = 8
PROMPT_LENGTHS = {"first": 2000, "second": 1500}  # neither a multiple of CHUNK: the tail is always computed
# LMCache's adapters log these when their heartbeats see the server go, and come back (after re-registering). An
# engine has two, each with its own heartbeat: the scheduler's (lookups) and the worker's (stores and loads).
DEGRADED = "LMCache server is unhealthy — entering degraded mode"
RECOVERED = "LMCache server is healthy again — resuming normal operation"
ADAPTERS = 2
REQUESTED = "lmcache_mp_lookup_requested_tokens_total"
HIT = "lmcache_mp_lookup_hit_tokens_total"
L1_WRITE = "lmcache_mp_l1_write_chunks_total"
L1_READ = "lmcache_mp_l1_read_chunks_total"
LOADED = "lmcache_mp_num_chunks_loaded_total"
DROPPED = "lmcache_mp_event_bus_dropped_events_total"
EXTERNAL = "vllm:prompt_tokens_by_source{source=external_kv_transfer}"
COMPUTED = "vllm:prompt_tokens_by_source{source=local_compute}"


def prompts() -> dict[str, list[int]]:
    """Random token ids, the same every run, sharing no chunk with each other."""
    chooser = random.Random(37)
    return {name: [chooser.randrange(VOCAB) for _ in range(length)] for name, length in PROMPT_LENGTHS.items()}


def whole_chunks(prompt: list[int]) -> int:
    assert len(prompt) % CHUNK, "a prompt of whole chunks would leave vLLM no token to compute"
    return len(prompt) // CHUNK


# -- README's block ----------------------------------------------------------------------------------------------

README_BLOCK = re.compile(r"## Use it from vLLM\n.*?```sh\n(.*?)```", re.S)


def readme_configuration() -> tuple[list[str], dict]:
    """(start-cache's flags, vLLM's kv_transfer_config) from README's "Use it from vLLM" block."""
    match = README_BLOCK.search(README.read_text())
    assert match, "README.md has no ```sh block under '## Use it from vLLM'"
    start, serve = [shlex.split(line) for line in match.group(1).strip().splitlines()]
    assert start[0] == "bin/start-cache" and serve[:2] == ["vllm", "serve"], (start, serve)
    config = json.loads(serve[serve.index("--kv-transfer-config") + 1])
    return start[1:], config


def with_port(flags: list[str], config: dict, port: int) -> tuple[list[str], dict]:
    """README's configuration with its port replaced by ``port`` (the test's free one), everything else as is."""
    readme_port = config["kv_connector_extra_config"]["lmcache.mp.port"]
    assert flags[flags.index("--lmcache-port") + 1] == str(readme_port)
    flags = [str(port) if flag == str(readme_port) else flag for flag in flags]
    extra = dict(config["kv_connector_extra_config"], **{"lmcache.mp.port": port})
    return flags, dict(config, kv_connector_extra_config=extra)


def test_readme_states_what_the_test_measures() -> None:
    """The prose under README's block quotes the prompt length and the tokens loaded that the test checks."""
    text = README_BLOCK.search(README.read_text()).group(0) + README.read_text().split("```sh", 2)[-1][:2000]
    length = PROMPT_LENGTHS["first"]
    assert f"a {length:,}-token prompt" in text
    assert f"takes {length // CHUNK * CHUNK:,} of its tokens (its\nwhole {CHUNK}-token chunks)" in text


# -- the service -----------------------------------------------------------------------------------------------


def start_cache(start_service, flags: list[str], port: int) -> Service:
    """README's start-cache flags; ready once its cache process listens on the LMCache port."""
    service = start_service(*flags)
    url = f"tcp://127.0.0.1:{port}"
    wait_for(lambda: service.process.poll() is not None or service.lines("cache.start", lmcache_urls=[url]), 60,
             "the cache process to listen on the LMCache port")
    assert service.process.poll() is None, f"start-cache exited {service.process.returncode}: {service.stderr_tail()}"
    wait_for(service.scrape, 60, "/metrics")
    return service


def settled(service: Service, expected: dict[str, float], timeout_s: float = 30) -> dict[str, float]:
    """/metrics' values of ``expected``'s names once they equal it (counted asynchronously), else the last seen."""
    seen: dict[str, float] = {}

    def matches() -> bool:
        scrape: Scrape = service.scrape()
        seen.update({name: scrape.total(name) for name in expected})
        return seen == expected

    try:
        wait_for(matches, timeout_s, "/metrics to count the engines' traffic")
    except AssertionError:
        pass
    return seen


def traffic(lookups: list[list[int]], stored: list[list[int]], loaded: list[list[int]]) -> dict[str, float]:
    """What mpcache counts for these lookups (one per request: its prompt's whole chunks), hits (the prompts whose
    chunks were loaded), stores and retrieves (one L1 object per chunk at TP 1)."""
    return {REQUESTED: sum(whole_chunks(p) for p in lookups) * CHUNK,
            HIT: sum(whole_chunks(p) for p in loaded) * CHUNK,
            L1_WRITE: sum(whole_chunks(p) for p in stored), L1_READ: sum(whole_chunks(p) for p in loaded),
            LOADED: sum(whole_chunks(p) for p in loaded), DROPPED: 0}


# -- the engines -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(vllm_python, tiny_model, tmp_path_factory) -> dict[str, list[int]]:
    """The tokens a connector-less engine generates for each prompt (greedy)."""
    # One process instead of three (front end, engine core, worker): a minute less to start on 2 busy cores. Only
    # without a connector: with LMCache's imported in the same process, vLLM 0.32's CPU start-up fails
    # (register_triton_kernel_overrides: "'_lib_fn_wrapper' object has no attribute 'get'").
    engine = Engine(vllm_python, tiny_model, tmp_path_factory.mktemp("reference") / "engine.stderr",
                    env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    try:
        engine.wait_ready()
        return {name: engine.generate(prompt, MAX_TOKENS)["tokens"] for name, prompt in prompts().items()}
    finally:
        engine.stop()


def ask(engine: Engine, prompt: list[int], reference_tokens: list[int]) -> dict:
    """One request; its generated tokens equal the connector-less engine's, and vLLM's counters moved by exactly
    this prompt.  Returns what vLLM says it loaded and computed for it."""
    reply = engine.generate(prompt, MAX_TOKENS)
    moved = {name: reply["moved"][name] for name in (EXTERNAL, COMPUTED)}
    assert reply["tokens"] == reference_tokens, "generated tokens differ from the connector-less engine's"
    assert moved[EXTERNAL] + moved[COMPUTED] == len(prompt), moved
    assert moved[EXTERNAL] == reply["num_cached_tokens"], (moved, reply["num_cached_tokens"])
    return moved


def wait_logged(engines: tuple[Engine, ...], text: str, timeout_s: float = 60) -> None:
    """Until every engine's stderr holds ``text`` once per adapter (each adapter's heartbeat logs it)."""
    wait_for(lambda: all(engine.log_count(text) >= ADAPTERS for engine in engines), timeout_s,
             f"the engines to log {text!r} {ADAPTERS} times each")


def loaded_all_chunks(prompt: list[int]) -> dict[str, int]:
    return {EXTERNAL: whole_chunks(prompt) * CHUNK, COMPUTED: len(prompt) - whole_chunks(prompt) * CHUNK}


def computed_all(prompt: list[int]) -> dict[str, int]:
    return {EXTERNAL: 0, COMPUTED: len(prompt)}


def test_vllm_takes_prefixes_from_mpcache_shares_them_and_survives_its_restart(
        reference, start_engine, start_service) -> None:
    """Two vLLM engines on one mpcache, configured as README says.  Engine A computes a prompt, then loads its
    whole chunks from mpcache the second time; engine B loads them on its first request; mpcache's /metrics count
    exactly those lookups, stores and loads.  mpcache then stops: both engines notice (LMCache's heartbeat), keep
    serving, computing every prompt; a new mpcache on the same port is noticed too, and caching resumes
    (A stores, B loads) without restarting vLLM, counted exactly by the new service."""
    port = free_ports(1, run=True)[0]
    flags, config = with_port(*readme_configuration(), port)
    p = prompts()
    first, second = p["first"], p["second"]
    service = start_cache(start_service, flags, port)
    a, b = start_engine("A", config), start_engine("B", config)
    wait_all_ready(a, b)

    assert ask(a, first, reference["first"]) == computed_all(first)
    assert ask(a, first, reference["first"]) == loaded_all_chunks(first)
    assert ask(b, first, reference["first"]) == loaded_all_chunks(first), "B did not get A's prefix"
    expected = traffic(lookups=[first] * 3, stored=[first], loaded=[first, first])
    assert settled(service, expected) == expected

    assert 0 == service.stop()
    wait_logged((a, b), DEGRADED)
    assert ask(a, second, reference["second"]) == computed_all(second), "served while mpcache was down"

    service = start_cache(start_service, flags, port)
    wait_logged((a, b), RECOVERED)
    assert ask(a, second, reference["second"]) == computed_all(second), "the new mpcache started empty"
    assert ask(b, second, reference["second"]) == loaded_all_chunks(second), "caching did not resume"
    expected = traffic(lookups=[second] * 2, stored=[second], loaded=[second])
    assert settled(service, expected) == expected
    assert 0 == service.stop()


PRIVATE_SHM = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm && exec "$0" "$@"']
PICKLE_FALLBACK = "falling back to pickle transport"  # LMCache 0.5.6's worker, when it cannot open the pool


@pytest.fixture
def private_shm() -> list[str]:
    """A launcher that runs a command in its own mount namespace with an empty /dev/shm (a container that does not
    share the cache's); skipped, saying why, where one cannot be made."""
    try:
        probe = subprocess.run([*PRIVATE_SHM, "sh", "-c", 'test -z "$(ls -A /dev/shm)"'], capture_output=True,
                               text=True, timeout=30)
    except OSError as exc:
        pytest.skip(f"cannot make a private /dev/shm here: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private /dev/shm here (needs root and unshare): {probe.stderr.strip()[-300:]}")
    return PRIVATE_SHM


def test_an_engine_without_the_shared_dev_shm_keeps_serving_and_mpcache_says_why(
        reference, start_engine, start_service, private_shm) -> None:
    """vLLM in a mount namespace of its own (an empty /dev/shm, as in a container that does not share the cache's):
    LMCache 0.5.6's worker cannot open mpcache's pool and falls back to pickled tensors, which mpcache refuses; vLLM
    keeps serving, computing every prompt with the connector-less engine's output, nothing is stored, and
    mpcache's log says what to fix."""
    port = free_ports(1, run=True)[0]
    flags, config = with_port(*readme_configuration(), port)
    first = prompts()["first"]
    service = start_cache(start_service, flags, port)
    engine = start_engine("private-shm", config, launcher=private_shm)
    engine.wait_ready()
    for _ in range(2):
        assert ask(engine, first, reference["first"]) == computed_all(first)
    assert engine.log_count(PICKLE_FALLBACK), "the engine did not meet the case this test is about"
    refusals = wait_for(lambda: service.lines("client.error", op="commit_store"), 30, "mpcache's refusal")
    assert "map the shared-memory pool (same user, same /dev/shm)" in refusals[0]["error"]
    expected = traffic(lookups=[first] * 2, stored=[], loaded=[])
    assert settled(service, expected) == expected


# -- KV events ---------------------------------------------------------------------------------------------------

EVICTED = "lmcache_mp_l1_evicted_chunks_total"
L1_USED = "lmcache_mp_l1_memory_usage_bytes"
# One L1 object per chunk of the tiny model (engine.py SIZES["tiny"], bf16): layers x (K, V) x tokens x KV heads x
# head size x 2 bytes.
OBJECT_BYTES = 2 * 2 * CHUNK * 2 * (128 // 2) * 2
L1_OBJECTS = 16  # --l1-size: a store may hold a quarter of L1 uncommitted, so 4 objects per store at most
EVICTING = {"prompts": 7, "chunks": 4}  # 28 chunks stored into 16 objects' room: evictions
TOPIC = "kv@mpcache-test"
LMCACHE_MEDIUM = "CPU"  # the medium LMCache's worker gives what it re-publishes of the server's records
VLLM_MEDIUM = "GPU"  # vLLM's own prefix cache's medium (even on its CPU build)


def evicting_prompts() -> list[list[int]]:
    chooser = random.Random(38)
    return [[chooser.randrange(VOCAB) for _ in range(EVICTING["chunks"] * CHUNK + 50)]
            for _ in range(EVICTING["prompts"])]


def test_vllm_publishes_mpcaches_stores_and_evictions_as_kv_events(start_engine, start_service) -> None:
    """vLLM with KV events on (ZeroMQ, as a router subscribes) against an mpcache whose L1 holds fewer objects
    than the prompts have whole chunks.  LMCache 0.5.6's worker subscribes to mpcache's ``subscribe_kv_events`` (the
    ``kv_event_stream`` capability) and vLLM publishes, besides its own prefix cache's events (medium GPU), one
    ``BlockStored`` (medium CPU) per chunk mpcache stored, with that chunk's tokens and its parent, and one
    ``BlockRemoved`` per chunk mpcache evicted (both counted by /metrics).  What the feed still holds is exactly
    what L1 holds: every such block is found by a lookup on the native socket, every removed one is not, and
    their number fills L1's bytes in use."""
    port = free_ports(1, run=True)[0]
    flags, config = with_port(*readme_configuration(), port)
    service = start_cache(start_service, [*flags, "--l1-size", str(L1_OBJECTS * OBJECT_BYTES)], port)
    engine = start_engine("kv-events", config, kv_events_topic=TOPIC, prefix_caching=True)
    engine.wait_ready()
    prompts_sent = evicting_prompts()
    for prompt in prompts_sent:
        engine.generate(prompt, 1)

    batches: list[dict] = []
    stored_chunks = EVICTING["prompts"] * EVICTING["chunks"]

    def published(kind: str) -> list[dict]:
        return [event for batch in batches for event in batch["events"]
                if event["type"] == kind and event["medium"] == LMCACHE_MEDIUM]

    seen: dict[str, tuple[float, float]] = {}

    def caught_up() -> bool:
        # vLLM publishes what the worker received at its next step: a request of less than a chunk (nothing to
        # store) makes one
        engine.generate(prompts_sent[0][:20], 1)
        batches.extend(engine.kv_events())
        scrape = service.scrape()
        seen["mpcache"] = (scrape.total(L1_WRITE), scrape.total(EVICTED))
        seen["vLLM"] = (len(published("BlockStored")), len(published("BlockRemoved")))
        return seen["mpcache"][0] == stored_chunks and seen["mpcache"] == seen["vLLM"]

    try:
        wait_for(caught_up, 120, "vLLM to publish what mpcache stored and evicted")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; (stored, evicted) chunks: {seen}") from None
    assert [batch["seq"] for batch in batches] == list(range(len(batches))), "a batch went missing"
    assert {batch["topic"] for batch in batches} == {TOPIC}
    assert not [e for b in batches for e in b["events"] if e["type"] == "AllBlocksCleared"]

    stored = published("BlockStored")
    assert [event["token_ids"] for event in stored] == [
        prompt[i * CHUNK:(i + 1) * CHUNK] for prompt in prompts_sent for i in range(EVICTING["chunks"])]
    assert all(len(event["block_hashes"]) == 1 and event["block_size"] == CHUNK for event in stored)
    hashes = [event["block_hashes"][0] for event in stored]
    assert len(set(hashes)) == len(hashes)
    parents = [event["parent_block_hash"] for event in stored]
    chunks = EVICTING["chunks"]
    assert parents == [None if i % chunks == 0 else hashes[i - 1] for i in range(len(hashes))], "a parent is wrong"

    removed = [block for event in published("BlockRemoved") for block in event["block_hashes"]]
    assert removed and len(set(removed)) == len(removed) and set(removed) <= set(hashes)
    held = [block for block in hashes if block not in set(removed)]
    assert settled(service, {L1_USED: len(held) * OBJECT_BYTES}) == {L1_USED: len(held) * OBJECT_BYTES}
    model = service.lines("lmcache.engine_registered")[0]["model"]
    native = CacheClient(service.socket(0))
    try:
        found = {}
        for index, block in enumerate(hashes):
            job = native.lookup_prefetch(request_id=f"probe{index}", model_name=model, chunk_hashes=[block])
            found[block] = native.wait_prefetch(job).found_count
            native.end_session(f"probe{index}")
    finally:
        native.close()
    assert found == {block: int(block in held) for block in hashes}, "the feed and L1 disagree"

    own = [event for batch in batches for event in batch["events"] if event["medium"] == VLLM_MEDIUM]
    assert own and not {block for event in own for block in event["block_hashes"]} & set(hashes)
    assert {event["medium"] for batch in batches for event in batch["events"]} == {LMCACHE_MEDIUM, VLLM_MEDIUM}
    assert 0 == service.stop()

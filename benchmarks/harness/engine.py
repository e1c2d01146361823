"""A real vLLM engine (``vllm.LLM``) driven over stdin/stdout, for tests/vllm and ``python -m benchmarks vllm``.

Runs with the python of the venv ``.ci/vllm-env`` builds (vLLM's CPU build with LMCache 0.5.6's MP connector),
never mpcache's; it imports nothing of mpcache.  Two commands:

``make-model DIR --size tiny|bench``
    writes a Llama with random weights (fixed seed, so every run gets the same model) into DIR with
    transformers: no hub is needed.  ``tiny`` (2 layers) for the tests, ``bench`` (~100M parameters) for
    the benchmark, large enough that prefill dominates a request on a CPU.

``serve --model DIR [--kv-transfer-config JSON] [--kv-events-topic TOPIC] [--prefix-caching]``
    starts one engine (prefix cache off unless asked, so every prompt token is either computed or loaded
    through the connector; ``skip_tokenizer_init``: prompts are token ids), prints ``{"ready": ...}`` on a
    line, then answers one JSON line per JSON line read:
    ``{"op": "generate", "prompt": [ids], "max_tokens": n}`` → the generated token ids, the tokens vLLM
    counted as cached for the request, the wall time, and vLLM's own counters after the request;
    ``{"op": "kv_events"}`` → the KV-event batches received since the last time (below);
    ``{"op": "exit"}`` ends it.  An exception in a request is answered ``{"error": ...}``; the engine stays up.
    With ``--kv-events-topic``, vLLM publishes its KV events (``kv_events_config``: ZeroMQ, that topic) to a
    SUB socket this process binds on loopback first, as a router does, and decodes with vLLM's own types.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback

# No usage reports leave the machine, and no stray parallelism on shared cores (prefill times swing 20× with it).
for _name, _value in {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false",
                      "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                      # threads left unpinned: vLLM's "auto" pins every engine to the same first core
                      "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():
    os.environ.setdefault(_name, _value)

SIZES = {  # LlamaConfig arguments; head_dim 64 is one the CPU attention backend serves
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 2, "vocab_size": 1024},
    "bench": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_key_value_heads": 4, "vocab_size": 32000},
}
MAX_MODEL_LEN = 4096
SEED = 0
# The counters vLLM itself keeps (its Prometheus registry, read through LLM.get_metrics()).
COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prompt_tokens_by_source",
            "vllm:request_success")
HISTOGRAMS = ("vllm:request_prefill_time_seconds", "vllm:time_to_first_token_seconds")


def make_model(directory: str, size: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(max_position_embeddings=MAX_MODEL_LEN, torch_dtype="bfloat16", **SIZES[size])
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    return {"model": directory, "parameters": sum(p.numel() for p in model.parameters()), **SIZES[size]}


def read_metrics(llm) -> dict:
    """vLLM's counters as ``name{label=value,...}`` → value; histograms as their count and sum."""
    from vllm.v1.metrics.reader import Counter, Histogram

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        labels = ",".join(f"{k}={v}" for k, v in sorted(metric.labels.items()) if k not in ("engine", "model_name"))
        key = f"{metric.name}{{{labels}}}" if labels else metric.name
        if isinstance(metric, Counter) and metric.name in COUNTERS:
            out[key] = out.get(key, 0) + metric.value
        elif isinstance(metric, Histogram) and metric.name in HISTOGRAMS:
            out[key + ":count"] = out.get(key + ":count", 0) + metric.count
            out[key + ":sum"] = out.get(key + ":sum", 0.0) + metric.sum
    return out


class KVEventFeed:
    """What a router receives from vLLM's KV-event publisher: a SUB socket bound on loopback (vLLM's publisher
    connects to an endpoint with a host), read by a thread, each batch decoded with vLLM's own msgspec types."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self._batches: list[dict] = []
        self._lock = threading.Lock()
        self._bound = threading.Event()
        self.endpoint = ""
        threading.Thread(target=self._receive, daemon=True, name="kv-event-feed").start()
        if not self._bound.wait(60):
            raise RuntimeError("the KV-event SUB socket was not bound within 60 s")

    def _receive(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        socket = zmq.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        socket.bind("tcp://127.0.0.1:0")
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._bound.set()
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while True:
            topic, seq, payload = socket.recv_multipart()
            batch = decoder.decode(payload)
            decoded = {"topic": topic.decode(), "seq": int.from_bytes(seq, "big"),
                       "events": [_event(event) for event in batch.events]}
            with self._lock:
                self._batches.append(decoded)

    def take(self) -> list[dict]:
        with self._lock:
            batches, self._batches = self._batches, []
        return batches


def _event(event) -> dict:
    """One event as JSON: its type and what a router reads of it (hashes as vLLM sent them: ints by default,
    bytes as hex)."""
    def block_hash(value):
        return value.hex() if isinstance(value, bytes) else value

    out = {"type": type(event).__name__, "medium": getattr(event, "medium", None)}
    if hasattr(event, "block_hashes"):
        out["block_hashes"] = [block_hash(value) for value in event.block_hashes]
    if hasattr(event, "token_ids"):
        out.update(parent_block_hash=block_hash(event.parent_block_hash), token_ids=list(event.token_ids),
                   block_size=event.block_size)
    return out


def serve(model: str, kv_transfer_config: str | None, kv_cache_gb: int, kv_events_topic: str | None,
          prefix_caching: bool) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    options: dict = {"kv_transfer_config": json.loads(kv_transfer_config)} if kv_transfer_config else {}
    feed = KVEventFeed(kv_events_topic) if kv_events_topic is not None else None
    if feed is not None:
        options["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                     endpoint=feed.endpoint, topic=feed.topic)
    started = time.monotonic()
    llm = LLM(model=model, skip_tokenizer_init=True, enable_prefix_caching=prefix_caching, enforce_eager=True,
              max_model_len=MAX_MODEL_LEN, seed=SEED, disable_log_stats=False, **options)
    reply({"ready": True, "vllm": vllm.__version__, "start_s": round(time.monotonic() - started, 3),
           "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
           "kv_events_endpoint": feed.endpoint if feed is not None else None})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("op") == "exit":
            break
        if command.get("op") == "kv_events":
            reply({"kv_events": feed.take() if feed is not None else []})
            continue
        try:
            params = SamplingParams(max_tokens=command["max_tokens"], temperature=0.0, detokenize=False)
            begun = time.monotonic()
            [output] = llm.generate(TokensPrompt(prompt_token_ids=command["prompt"]), params, use_tqdm=False)
            wall_s = time.monotonic() - begun
            reply({"tokens": list(output.outputs[0].token_ids), "num_cached_tokens": output.num_cached_tokens,
                   "wall_s": wall_s, "metrics": read_metrics(llm)})
        except Exception as exc:  # noqa: BLE001 -- one bad request is reported; the engine keeps serving
            reply({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]})


def reply(message: dict) -> None:
    print(json.dumps(message), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-model")
    make.add_argument("directory")
    make.add_argument("--size", choices=sorted(SIZES), default="tiny")
    run = commands.add_parser("serve")
    run.add_argument("--model", required=True)
    run.add_argument("--kv-transfer-config", default=None, help="vLLM's kv_transfer_config, JSON")
    run.add_argument("--kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE unless set (default 1)")
    run.add_argument("--kv-events-topic", default=None, help="publish vLLM's KV events on this topic and read them")
    run.add_argument("--prefix-caching", action="store_true", help="vLLM's own prefix cache on (default off)")
    args = parser.parse_args()
    if args.command == "make-model":
        reply(make_model(args.directory, args.size))
    else:
        serve(args.model, args.kv_transfer_config, args.kv_cache_gb, args.kv_events_topic, args.prefix_caching)


if __name__ == "__main__":
    main()

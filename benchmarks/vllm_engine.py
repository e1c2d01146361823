"""A real vLLM engine: ``benchmarks/harness/engine.py serve`` started with the python of vLLM's venv (``.ci/vllm-env``),
asked one request at a time over its stdin/stdout.  The one engine starter of ``python -m benchmarks vllm`` and of
the tests (tests/vllm).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.process_group import stop_group

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "benchmarks" / "harness" / "engine.py"
# Every process that imports vllm or lmcache: no usage reports leave the machine; one OpenMP thread on shared cores.
ENGINE_ENV = {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false",
              "LMCACHE_DISABLE_BANNER": "1", "OMP_NUM_THREADS": "1"}
START_TIMEOUT_S = 420  # import torch + vLLM and start the engine on 2 busy cores
REQUEST_TIMEOUT_S = 180


def lmcache_mp_connector(port: int) -> dict[str, Any]:
    """The ``kv_transfer_config`` of LMCache 0.5.6's MP connector on a server at 127.0.0.1:``port``."""
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                                          "lmcache.mp.mq_timeout": 60}}


class EngineFailed(RuntimeError):
    """The engine exited, did not answer in time, or answered a request with an error (its stderr's tail said)."""


class Engine:
    """``engine.py serve`` in vLLM's venv: one ``vllm.LLM``, asked one request at a time, its stderr in a file."""

    def __init__(self, python: str, model: str | Path, stderr_path: str | Path,
                 kv_transfer_config: dict | None = None, env: dict[str, str] | None = None,
                 launcher: list[str] | None = None, name: str = "vLLM", kv_events_topic: str | None = None,
                 prefix_caching: bool = False) -> None:
        argv = [python, str(ENGINE), "serve", "--model", str(model)]
        if kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        if kv_events_topic is not None:
            argv += ["--kv-events-topic", kv_events_topic]
        if prefix_caching:
            argv.append("--prefix-caching")
        self.name = name
        self.stderr_path = Path(stderr_path)
        self.started_at = time.time()
        self.swept: list[str] = []
        with open(stderr_path, "wb") as stderr:
            self.process = subprocess.Popen((launcher or []) + argv, env=dict(os.environ, **ENGINE_ENV, **(env or {})),
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                            cwd=REPO, start_new_session=True)
        self._replies: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready: dict[str, Any] | None = None
        self.metrics: dict[str, float] = {}  # vLLM's counters after the last request

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                self._replies.put(json.loads(line))
            except ValueError:
                continue  # a library's print on stdout, not a reply
        self._replies.put(None)

    def stderr_tail(self, chars: int = 4000) -> str:
        return self.stderr_path.read_text(errors="replace")[-chars:] if self.stderr_path.exists() else ""

    def _next(self, timeout_s: float, what: str) -> dict:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise EngineFailed(f"the {self.name} engine did not answer {what} within {timeout_s:.0f} s; stderr:\n"
                               f"{self.stderr_tail()}") from None
        if reply is None:
            raise EngineFailed(f"the {self.name} engine exited ({self.process.poll()}) before answering {what}; "
                               f"stderr:\n{self.stderr_tail()}")
        return reply

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> dict:
        self.ready = self._next(timeout_s, "its start-up")
        if not self.ready.get("ready"):
            raise EngineFailed(f"the {self.name} engine did not start: {self.ready}")
        return self.ready

    def generate(self, prompt: list[int], max_tokens: int, timeout_s: float = REQUEST_TIMEOUT_S) -> dict:
        """One greedy request: ``tokens``, ``num_cached_tokens``, ``wall_s``, vLLM's counters after it (``metrics``)
        and how far each moved during it (``moved``)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": "generate", "prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        reply = self._next(timeout_s, f"a request of {len(prompt)} tokens")
        if "error" in reply:
            raise EngineFailed(f"the {self.name} engine failed a request: {reply['error']}\n"
                               f"{reply.get('traceback', '')}\n{self.stderr_tail()}")
        reply["moved"] = {name: value - self.metrics.get(name, 0) for name, value in reply["metrics"].items()}
        self.metrics = reply["metrics"]
        return reply

    def kv_events(self, timeout_s: float = REQUEST_TIMEOUT_S) -> list[dict]:
        """The KV-event batches vLLM published since the last call, as its ``--kv-events-topic`` subscriber
        decoded them (``topic``, ``seq``, ``events``)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": "kv_events"}) + "\n")
        self.process.stdin.flush()
        return self._next(timeout_s, "a read of its KV events")["kv_events"]

    def log_count(self, text: str) -> int:
        return self.stderr_tail(1 << 22).count(text)

    def stop(self, timeout_s: float = 60) -> int | None:
        """Ask it to exit (vLLM stops its engine-core and worker processes), then end whatever is left of its
        process group (a front end killed first would leave those two running, orphaned) without leaving its
        shared memory behind (:func:`~benchmarks.process_group.stop_group`): the front end's exit status, or None
        if it had to be killed.  ``swept``: the segments the group left, unlinked here."""
        if self.process.poll() is None and self.process.stdin is not None:
            try:
                self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.process.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
        self.swept = stop_group(self.process.pid, timeout_s, self.started_at)
        status = self.process.wait()
        return status if status >= 0 else None


def wait_all_ready(*engines: Engine, timeout_s: float = START_TIMEOUT_S) -> None:
    """Started together, waited for together (their start-ups overlap)."""
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        engine.wait_ready(max(1.0, deadline - time.monotonic()))

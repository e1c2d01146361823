"""An LMCache MP client run as another local user: ``python -m support.lmcache_attacker URL`` (tests/ on the path).

Each line on stdin is one job, a JSON object ``{"calls": [[op, arg, …], …], "timeout_s": T, "sync": bool}``.
For each job it opens a fresh DEALER socket to URL, sends every call at once (pipelined, each with its own
uid), prints ``{"sent": n}``; with ``sync`` it then waits for one more stdin line (any text) before it
listens.  It listens until every call is answered or ``T`` seconds have passed, prints one JSON line per
call — ``{"op": op, "reply": value}``, ``{"op": op, "no_result": true}`` (a reply without a result frame)
or ``{"op": op, "no_reply": true}`` — then ``{"done": true}``, and closes the socket.

Bytes travel as ``{"__bytes__": "<hex>"}`` both ways (JSON has no bytes).  Needs only pyzmq and msgpack.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import msgpack
import zmq

from support.lmcache_client import OPS
from support.zmq_sockets import dealer


def to_wire(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return bytes.fromhex(value["__bytes__"])
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_wire(v) for v in value]
    return value


def to_json(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"__bytes__": value.hex()}
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def run_job(context: zmq.Context, url: str, job: dict) -> None:
    socket = dealer(context)
    socket.connect(url)
    calls = job["calls"]
    results: list[dict | None] = [None] * len(calls)
    uids: dict[bytes, int] = {}
    for index, call in enumerate(calls):
        op, args = call[0], to_wire(call[1:])
        uid = msgpack.packb(1000 + index)
        uids[uid] = index
        frames = [uid, msgpack.packb(OPS.get(op, op) if isinstance(op, str) else op)]
        frames += [msgpack.packb(arg, use_bin_type=True) for arg in args]
        try:
            socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            results[index] = {"op": op, "no_reply": True, "send_failed": True}
    emit({"sent": len(calls)})
    if job.get("sync"):
        sys.stdin.readline()
    deadline = time.monotonic() + float(job["timeout_s"])
    while any(result is None for result in results):
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0 or not socket.poll(left_ms):
            break
        reply = socket.recv_multipart()
        index = uids.get(reply[0])
        if index is None or results[index] is not None:
            continue
        op = calls[index][0]
        if len(reply) >= 3:
            results[index] = {"op": op, "reply": to_json(msgpack.unpackb(reply[2], raw=False, strict_map_key=False))}
        else:
            results[index] = {"op": op, "no_result": True}
    for index, result in enumerate(results):
        emit(result if result is not None else {"op": calls[index][0], "no_reply": True})
    emit({"done": True})
    socket.close(linger=0)


def main() -> None:
    url = sys.argv[1]
    context = zmq.Context()
    for line in sys.stdin:
        if line.strip():
            run_job(context, url, json.loads(line))
    context.term()


if __name__ == "__main__":
    main()

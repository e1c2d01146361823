"""Parse ``vllm serve`` command lines with vLLM's own parser: run in a venv that has vLLM (never imports mpcache).

Reads a JSON list of argument lists (what follows ``vllm serve``) on stdin and prints one JSON list: for each,
``{"error": message}`` when vLLM's parser refuses it, else the settings the deployment checks need: the model,
host, port, tensor and pipeline parallel sizes and the KV transfer config as vLLM resolved it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser


def parse(argv: list[str]) -> dict:
    root = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(root.add_subparsers(dest="subcommand"))
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = root.parse_args(["serve", *argv])
    except SystemExit:
        return {"error": stderr.getvalue().strip().splitlines()[-1]}
    engine = AsyncEngineArgs.from_cli_args(args)
    kv = engine.kv_transfer_config
    return {"model": args.model_tag, "host": args.host, "port": args.port,
            "tensor_parallel_size": engine.tensor_parallel_size,
            "pipeline_parallel_size": engine.pipeline_parallel_size,
            "kv_transfer_config": None if kv is None else {
                "kv_connector": kv.kv_connector, "kv_role": kv.kv_role,
                "kv_connector_extra_config": kv.kv_connector_extra_config}}


if __name__ == "__main__":
    print(json.dumps([parse(argv) for argv in json.load(sys.stdin)]))

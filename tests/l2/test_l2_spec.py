"""The --l2 flag: accepted specs, one-line errors naming --l2, and the adapters built from specs."""

from __future__ import annotations

import json

import pytest
from support.l2 import MAC_KEY

from mpcache.cache.l2.fs import FsL2Adapter
from mpcache.cache.l2.mock import MockL2Adapter
from mpcache.cache.l2.spec import build_adapter, parse_l2_spec
from mpcache.contract.keys import ChunkKey
from mpcache.errors import ConfigError

GOOD = [
    '{"type": "fs", "path": "/var/cache/mpcache", "capacity_gb": 4}',
    '{"type": "fs", "path": "/tmp/x", "capacity_gb": 0.5, "threads": 8}',
    '{"type": "mock", "capacity_gb": 1}',
    '{"type": "mock", "capacity_gb": 1, "latency_ms": 2.5, "bandwidth_gbps": 10, "failure_rate": 1, "seed": 3}',
    '{"type": "redis", "url": "redis://cache-host:6379/0", "capacity_gb": 16}',
    '{"type": "redis", "url": "redis://10.0.0.5:6380/2", "capacity_gb": 2, "key_prefix": "p:", "threads": 2}',
    '{"type": "redis", "url": "redis://mpcache:s3cret@cache-host:6379/1", "capacity_gb": 1}',
    '{"type": "redis", "url": "rediss://cache-host:6380/0", "capacity_gb": 1, "tls_ca_file": "/etc/ca.pem", '
    '"tls_cert_file": "/etc/c.pem", "tls_key_file": "/etc/c.key", "password_file": "/etc/redis.pw"}',
    '{"type": "redis", "url": "redis://h:1/0", "capacity_gb": 1, "socket_timeout_s": 0.25, "connect_timeout_s": 2}',
    '{"type": "redis", "url": "redis://seed:7000", "capacity_gb": 8, "cluster": true}',
    '{"type": "redis", "url": "redis://seed:7000/0", "capacity_gb": 8, "cluster": true, "shards": 64}',
    '{"type": "redis", "url": "redis://h:1/3", "capacity_gb": 1, "cluster": false, "shards": 4}',
]


@pytest.mark.parametrize("text", GOOD)
def test_accepted_specs_parse_to_their_json(text):
    """Every documented form parses to the object it spells."""
    assert json.loads(text) == parse_l2_spec(text)


BAD = {
    "not_json": "{type: fs}",
    "empty": "",
    "not_an_object": '["fs"]',
    "no_type": '{"capacity_gb": 1}',
    "unknown_type": '{"type": "s3", "capacity_gb": 1}',
    "unknown_key": '{"type": "mock", "capacity_gb": 1, "latency": 5}',
    "key_of_another_type": '{"type": "fs", "path": "/x", "capacity_gb": 1, "seed": 1}',
    "missing_path": '{"type": "fs", "capacity_gb": 1}',
    "missing_capacity": '{"type": "mock"}',
    "zero_capacity": '{"type": "mock", "capacity_gb": 0}',
    "negative_capacity": '{"type": "fs", "path": "/x", "capacity_gb": -1}',
    "string_capacity": '{"type": "mock", "capacity_gb": "4"}',
    "bool_capacity": '{"type": "mock", "capacity_gb": true}',
    "infinite_capacity": '{"type": "mock", "capacity_gb": Infinity}',
    "failure_rate_above_one": '{"type": "mock", "capacity_gb": 1, "failure_rate": 1.5}',
    "float_seed": '{"type": "mock", "capacity_gb": 1, "seed": 1.5}',
    "zero_threads": '{"type": "fs", "path": "/x", "capacity_gb": 1, "threads": 0}',
    "empty_path": '{"type": "fs", "path": "", "capacity_gb": 1}',
    "http_url": '{"type": "redis", "url": "http://host:6379/0", "capacity_gb": 1}',
    "url_without_host": '{"type": "redis", "url": "redis:///0", "capacity_gb": 1}',
    "url_with_bad_db": '{"type": "redis", "url": "redis://host:6379/cache", "capacity_gb": 1}',
    "url_with_bad_port": '{"type": "redis", "url": "redis://host:port/0", "capacity_gb": 1}',
    "url_with_a_query": '{"type": "redis", "url": "redis://host:6379/0?ssl_cert_reqs=none", "capacity_gb": 1}',
    "zero_socket_timeout": '{"type": "redis", "url": "redis://h:1/0", "capacity_gb": 1, "socket_timeout_s": 0}',
    "tls_file_without_rediss": '{"type": "redis", "url": "redis://h:1/0", "capacity_gb": 1, "tls_ca_file": "/c"}',
    "client_cert_without_key": '{"type": "redis", "url": "rediss://h:1/0", "capacity_gb": 1, "tls_cert_file": "/c"}',
    "cluster_not_a_bool": '{"type": "redis", "url": "redis://h:1", "capacity_gb": 1, "cluster": "yes"}',
    "zero_shards": '{"type": "redis", "url": "redis://h:1", "capacity_gb": 1, "shards": 0}',
    "too_many_shards": '{"type": "redis", "url": "redis://h:1", "capacity_gb": 1, "shards": 1025}',
    "cluster_with_a_db": '{"type": "redis", "url": "redis://h:1/2", "capacity_gb": 1, "cluster": true}',
    "cluster_prefix_with_a_tag": '{"type": "redis", "url": "redis://h:1", "capacity_gb": 1, "cluster": true, '
                                 '"key_prefix": "a{b}:"}',
}


@pytest.mark.parametrize("text", BAD.values(), ids=BAD.keys())
def test_bad_specs_raise_one_line_naming_the_flag_and_the_accepted_form(text):
    """Each bad --l2 value raises ConfigError: one line, starting with --l2, showing the accepted form."""
    with pytest.raises(ConfigError) as caught:
        parse_l2_spec(text)
    message = str(caught.value)

    assert (1, True, True) == (len(message.splitlines()), message.startswith("--l2: "),
                               '{"type": "fs", "path": "/var/cache/mpcache", "capacity_gb": 4}' in message)


def test_the_error_says_what_is_wrong():
    """The message names the offending key and what it must be."""
    with pytest.raises(ConfigError, match=r"mock 'failure_rate' must be a number in \[0, 1\], got 1\.5"):
        parse_l2_spec('{"type": "mock", "capacity_gb": 1, "failure_rate": 1.5}')


def test_a_password_in_a_bad_url_is_not_echoed():
    """A bad redis URL that carries a password is reported without it."""
    with pytest.raises(ConfigError) as caught:
        parse_l2_spec('{"type": "redis", "url": "redis://u:hunter2@host:port/0", "capacity_gb": 1}')

    assert ("hunter2" not in str(caught.value), "(hidden)" in str(caught.value)) == (True, True)


def test_build_makes_an_fs_adapter_with_the_capacity_in_bytes(tmp_path):
    """An fs spec builds an FsL2Adapter on its path; capacity_gb is decimal GB."""
    adapter = build_adapter({"type": "fs", "path": str(tmp_path), "capacity_gb": 0.25, "threads": 2}, 65536, MAC_KEY)
    try:
        assert (FsL2Adapter, str(tmp_path), 250_000_000) == (type(adapter), adapter.path, adapter.capacity_bytes)
    finally:
        adapter.close()


def test_build_makes_a_mock_adapter_with_its_options():
    """A mock spec's latency_ms, bandwidth_gbps (GB/s) and failure_rate reach the adapter in base units."""
    adapter = build_adapter({"type": "mock", "capacity_gb": 1, "latency_ms": 5, "bandwidth_gbps": 2,
                             "failure_rate": 0.5}, 65536)
    try:
        assert (MockL2Adapter, 10**9, 0.005, 2e9, 0.5) == (
            type(adapter), adapter.capacity_bytes, adapter.latency_s, adapter.bandwidth_bytes_per_s,
            adapter.failure_rate)
    finally:
        adapter.close()


def test_build_makes_a_redis_adapter_without_connecting():
    """A redis spec builds its adapter even when the server is not up yet (stores would then fail)."""
    from mpcache.cache.l2.redis_adapter import RedisL2Adapter

    adapter = build_adapter({"type": "redis", "url": "redis://127.0.0.1:1/0", "capacity_gb": 1,
                             "key_prefix": "x:"}, 65536, MAC_KEY)
    try:
        assert (RedisL2Adapter, "redis", "x:") == (type(adapter), adapter.name, adapter.key_prefix)
    finally:
        adapter.close()


@pytest.mark.parametrize("kind", ["fs", "redis"])
def test_build_refuses_a_record_tier_without_the_l2_key(kind, tmp_path):
    """fs and redis records are MAC'd with the deployment's key: building one without it is a ConfigError,
    never an unkeyed tier."""
    spec = {"type": "fs", "path": str(tmp_path), "capacity_gb": 1} if kind == "fs" else {
        "type": "redis", "url": "redis://127.0.0.1:1/0", "capacity_gb": 1}
    with pytest.raises(ConfigError, match=f"^--l2: a {kind} tier needs the deployment's L2 key"):
        build_adapter(spec, 65536)


def test_build_rejects_a_capacity_below_one_chunk():
    """A capacity that cannot hold one chunk is a ConfigError naming --l2."""
    with pytest.raises(ConfigError, match=r"^--l2: mock capacity_gb 1e-06 is smaller than one chunk \(65536 bytes\)"):
        build_adapter({"type": "mock", "capacity_gb": 0.000001}, 65536)


def test_build_makes_a_cluster_adapter_when_no_node_is_up_and_its_operations_fail_as_misses():
    """A cluster tier whose seed does not answer at start-up is still built (the cache process serves); its
    operations fail, counted, without raising, until the cluster answers."""
    from mpcache.cache.l2.redis_adapter import RedisL2Adapter

    adapter = build_adapter({"type": "redis", "url": "redis://127.0.0.1:1", "capacity_gb": 1, "cluster": True},
                            65536, MAC_KEY, "host-a")
    try:
        stored = adapter.submit_store([(ChunkKey("m", "", 1), b"x" * 65536)]).result(10)
        assert (RedisL2Adapter, True, 16, b"host-a") == (type(adapter), adapter.cluster, len(adapter._shards),
                                                         adapter.writer)
        assert ([ChunkKey("m", "", 1)], 1) == (stored.failed, adapter.failures.totals()["store_error"])
    finally:
        adapter.close()


def test_build_rejects_shards_smaller_than_a_chunk():
    """Every index shard must hold a chunk: capacity over shards below the chunk size is a ConfigError."""
    with pytest.raises(ConfigError, match=r"^--l2: redis capacity_gb 0.001 split over 16 shards holds less than"):
        build_adapter({"type": "redis", "url": "redis://h:1", "capacity_gb": 0.001, "cluster": True}, 65536, MAC_KEY)


def test_build_checks_the_spec_too():
    """build_adapter rejects a spec that did not come through parse_l2_spec."""
    with pytest.raises(ConfigError, match="^--l2: "):
        build_adapter({"type": "fs", "capacity_gb": 1}, 65536)

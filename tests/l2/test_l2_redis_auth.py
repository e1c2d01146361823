"""Redis deployed for a multi-tenant cache: a password (requirepass), an ACL user confined to the tier's key
prefix, a password file instead of a password on the command line, and TLS with verified certificates."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
import redis
from support.l2 import MAC_KEY, key, payload, wait

from mpcache.cache.l2.base import LoadResult, StoreResult
from mpcache.cache.l2.spec import build_adapter, parse_l2_spec
from mpcache.errors import ConfigError


def round_trip(adapter) -> tuple[StoreResult, LoadResult, bytes]:
    stored = wait(adapter.submit_store([(key(1), payload(1))]))
    buffer = bytearray(1000)
    loaded = wait(adapter.submit_load([key(1)], [memoryview(buffer)]))
    return stored, loaded, bytes(buffer)


OK = (StoreResult([key(1)], [], [], 1000, []), LoadResult([key(1)]), payload(1))


def tier(secured_redis, closing, url: str, prefix: str | None = None, **extra):
    """An adapter built the way a cache process builds it: from a parsed --l2 spec."""
    spec = {"type": "redis", "url": url, "capacity_gb": 1,
            "key_prefix": prefix or f"{secured_redis.acl_prefix}{uuid.uuid4().hex[:8]}:", **extra}
    return closing(build_adapter(parse_l2_spec(json.dumps(spec)), 65536, MAC_KEY))


def test_a_password_url_reaches_a_requirepass_server(secured_redis, closing):
    """``redis://:password@host:port/db`` authenticates (AUTH) and the tier works; without it nothing is
    stored, and the refusal is counted."""
    good = tier(secured_redis, closing, secured_redis.url(password=secured_redis.root_password))
    anonymous = tier(secured_redis, closing, secured_redis.url())

    assert OK == round_trip(good)
    assert StoreResult([], [], [key(1)], 0, []) == wait(anonymous.submit_store([(key(1), payload(1))]))
    assert 1 == anonymous.failures.totals()["store_error"]


def test_an_acl_user_url_works_within_its_key_pattern_only(secured_redis, closing):
    """``redis://user:password@host:port/db`` logs in as an ACL user (docs/L2.md's ACL line): its tier works
    under the permitted prefix, and a tier configured outside it stores nothing (NOPERM, counted)."""
    url = secured_redis.url(user=secured_redis.user, password=secured_redis.user_password)
    inside = tier(secured_redis, closing, url)
    outside = tier(secured_redis, closing, url, prefix="mpcache:l2:")

    assert OK == round_trip(inside)
    assert StoreResult([], [], [key(1)], 0, []) == wait(outside.submit_store([(key(1), payload(1))]))
    assert "no permissions" in repr(outside.failures.take())


def test_the_acl_line_docs_l2_recommends_is_the_one_these_tests_run(secured_redis):
    """docs/L2.md's ACL line, with this server's password and key prefix in place of its placeholders, is the
    line the secured server is started with: what the docs recommend is what the tests above exercise."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "L2.md").read_text(encoding="utf-8")
    [documented] = re.findall(r"^ *(user mpcache on .*)$", docs, re.MULTILINE)
    assert secured_redis.acl_line() == documented.replace(">LONG-RANDOM-PASSWORD", f">{secured_redis.user_password}") \
        .replace("~mpcache:l2:*", f"~{secured_redis.acl_prefix}*")


def test_the_acl_user_cannot_touch_other_applications_keys(secured_redis):
    """The same ACL stops the tier's credentials from reading or writing anything else on the server."""
    client = redis.Redis.from_url(secured_redis.url(user=secured_redis.user, password=secured_redis.user_password))
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set("session:42", b"x")
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.get("session:42")
    finally:
        client.close()


def test_a_password_file_keeps_the_password_off_the_command_line(secured_redis, closing, tmp_path):
    """``password_file`` (a file of ours, mode 0600) supplies the password; a group-readable one is refused."""
    good = tmp_path / "redis.pw"
    good.write_text(secured_redis.user_password + "\n")
    good.chmod(0o600)
    loose = tmp_path / "loose.pw"
    loose.write_text(secured_redis.user_password)
    loose.chmod(0o640)
    url = f"redis://{secured_redis.user}@127.0.0.1:{secured_redis.port}/0"

    adapter = tier(secured_redis, closing, url, password_file=str(good))
    with pytest.raises(ConfigError, match=f"^--l2: redis password_file '{loose}' is accessible by group or others"):
        tier(secured_redis, closing, url, password_file=str(loose))

    assert OK == round_trip(adapter)


@pytest.fixture
def tls(secured_redis):
    if secured_redis.tls_port is None:
        pytest.skip(secured_redis.tls_skip_reason)
    return secured_redis


def test_rediss_with_the_servers_ca_and_a_client_certificate(tls, closing):
    """``rediss://user:password@...`` with tls_ca_file (and a client certificate) talks TLS to the server,
    verifying its certificate and host name."""
    url = tls.url(user=tls.user, password=tls.user_password, tls=True)
    server_verified = tier(tls, closing, url, tls_ca_file=tls.ca)
    mutual = tier(tls, closing, url, tls_ca_file=tls.ca, tls_cert_file=tls.client_cert, tls_key_file=tls.client_key)

    assert [OK, OK] == [round_trip(server_verified), round_trip(mutual)]


def test_rediss_refuses_a_server_it_cannot_verify(tls, closing):
    """Without the CA that signed the server's certificate (the system CAs are used), nothing is sent: the
    store fails and the certificate error is counted."""
    adapter = tier(tls, closing, tls.url(user=tls.user, password=tls.user_password, tls=True))

    assert StoreResult([], [], [key(1)], 0, []) == wait(adapter.submit_store([(key(1), payload(1))]))
    assert "CERTIFICATE_VERIFY_FAILED" in repr(adapter.failures.take())


def test_plain_redis_is_not_accepted_on_the_tls_port(tls, closing):
    """A redis:// URL pointed at the TLS port gets nowhere (counted), rather than sending data in clear."""
    adapter = tier(tls, closing, f"redis://{tls.user}:{tls.user_password}@127.0.0.1:{tls.tls_port}/0",
                   socket_timeout_s=0.5)

    assert StoreResult([], [], [key(1)], 0, []) == wait(adapter.submit_store([(key(1), payload(1))]))
    assert 1 == adapter.failures.totals()["store_error"]

"""Fixtures for end-to-end tests: a real ``bin/start-cache`` process tree, killed at teardown."""

from __future__ import annotations

import pytest
from mpcache_service import Service


@pytest.fixture
def start_service(tmp_path):
    started: list[Service] = []

    def start(*flags: str) -> Service:
        service = Service(tmp_path, *flags)
        started.append(service)
        return service

    yield start
    for service in started:
        service.kill()

"""Fixtures for end-to-end tests: a real ``bin/start-cache`` process tree, killed at teardown."""

from __future__ import annotations

import pytest
from mpcache_service import Service
from service_control import started_services


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


@pytest.fixture
def controlled_services(tmp_path):
    """``start(*flags)`` → a :class:`service_control.ControlledService`, for tests that stop, kill or
    freeze children: the supervisor and every child it logged are killed at teardown."""
    yield from started_services(tmp_path)

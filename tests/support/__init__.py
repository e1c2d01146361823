"""The tests' own harness: one way to wait, to choose a port, to run ``bin/start-cache`` and to receive OTLP.

``tests/`` is on ``sys.path`` for every test (pytest puts the top conftest's folder there), so tests import
``support.waiting``, ``support.ports``, ``support.service`` and ``support.otlp_receiver``.
"""

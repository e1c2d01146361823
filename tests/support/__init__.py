"""The tests' own harness, one module per job: waiting with a deadline, ports, ``bin/start-cache`` process trees,
OTLP receivers, LMCache and native clients, raw frames, ring readers, a second local user, private networks, a
/dev/shm of a test's own.

pytest's ``pythonpath`` puts ``tests/`` on ``sys.path`` and test modules are imported by path (importlib mode), so
tests import ``support.*`` and never each other; a test's shared helper lives here.
"""

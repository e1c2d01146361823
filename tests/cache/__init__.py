"""Tests of the cache process: L1, server, protocol over a real socket."""

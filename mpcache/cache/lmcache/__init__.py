"""LMCache MP-mode compatibility: the ZeroMQ front end vLLM's LMCacheMPConnector talks to (engine_driven)."""

"""The contracts other processes rely on: ring event types, the client protocol, chunk keys and fingerprints."""

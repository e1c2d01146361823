"""The image's HEALTHCHECK: 0 while ``/healthz`` and ``/ready`` answer 200 where this run serves them (the
supervisor answers both, whatever the telemetry process does).

Where is read from the run's own ``config.json`` (in ``$MPCACHE_RUNTIME_DIR``), not assumed: a run bound
to all addresses is asked on the container's own address, as a peer would ask it, and a run bound to
loopback is unhealthy (a published port reaches nothing there).  One line on stdout says why.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import urllib.error
import urllib.request


def check() -> tuple[bool, str]:
    path = os.path.join(os.environ.get("MPCACHE_RUNTIME_DIR", "/run/mpcache/service"), "config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        return False, f"start-cache has not written {path} yet ({exc})"
    if config.get("no_http"):
        return False, "--no-http: no /healthz to check (replace this HEALTHCHECK)"
    host, port = str(config["prometheus_host"]), int(config["prometheus_port"])
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())  # the container's own address
    elif _loopback(host):
        return False, (f"/healthz is bound to {host}, unreachable from outside the container: "
                       "set MPCACHE_PROMETHEUS_HOST=0.0.0.0 (the image's default)")
    base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    for route in ("/healthz", "/ready"):
        try:
            with urllib.request.urlopen(base + route, timeout=4) as response:
                body = response.read().decode(errors="replace").strip()
        except urllib.error.HTTPError as error:
            return False, f"{base}{route}: {error.code} {error.read().decode(errors='replace').strip()}"
        except OSError as exc:
            return False, f"{base}{route}: {exc}"
    return True, f"{base}: {body}"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


if __name__ == "__main__":
    healthy, why = check()
    print(why)
    sys.exit(0 if healthy else 1)

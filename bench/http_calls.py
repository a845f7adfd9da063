"""CPU of one health-style HTTP call: a bare ``httpx.get`` (a TLS context built per call) against
``kvchaos.httpclient.get`` (one context per process), as a ratio from one run.

The server runs in a child process, so only the caller's CPU is counted (``time.process_time``); the
two arms alternate in rounds so drift hits both. The harness makes such calls every 0.5 s while a
cluster starts (health) and while it waits for quiet (``/metrics``).

Usage: python bench/http_calls.py [-n 200]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvchaos import httpclient  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=200, help="calls per arm (default 200)")
    n = ap.parse_args().n
    if n < 10:
        raise SystemExit("-n must be at least 10")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or srv.poll() is not None:
                    raise SystemExit("the local http.server did not answer within 20 s")
                time.sleep(0.1)
        cpu = {"httpx.get": 0.0, "httpclient.get": 0.0}
        arms = {"httpx.get": lambda: httpx.get(url, timeout=5), "httpclient.get": lambda: httpclient.get(url, timeout=5)}
        for _ in range(10):  # rounds, alternating
            for name, call in arms.items():
                t = time.process_time()
                for _ in range(n // 10):
                    assert call().status_code == 200
                cpu[name] += time.process_time() - t
        per = {k: 1000 * v / (n // 10 * 10) for k, v in cpu.items()}
        print(f"CPU per call, {n // 10 * 10} calls each, plain http to 127.0.0.1 (httpx {httpx.__version__}):")
        for k, v in per.items():
            print(f"  {k:16s} {v:7.2f} ms")
        print(f"ratio httpx.get / httpclient.get: {per['httpx.get'] / per['httpclient.get']:.1f}x")
    finally:
        srv.terminate()
        srv.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())

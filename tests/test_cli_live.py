"""``kvchaos up`` as an operator uses it: a real CPU cluster that serves until Ctrl-C, its URLs on
stdout and in ``--urls-file``, and nothing left running after it stops."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from kvchaos import canary, probe
from tests.util import child_env

pytestmark = [pytest.mark.cluster, pytest.mark.backends("mooncake_tcp")]


@pytest.mark.slow  # CI time; Ctrl-C cleanup is also tests/test_teardown_real.py (default)
def test_up_serves_until_ctrl_c_and_leaves_nothing(tmp_path):
    urls_file = tmp_path / "up.json"
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "kvchaos", "up", "--reports", str(tmp_path / "r"),
                             "--urls-file", str(urls_file)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not urls_file.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() - t0 < 400, "kvchaos up did not serve within 400 s"
            time.sleep(1)
        urls = json.loads(urls_file.read_text())
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(tree) >= 5, tree  # prefill, decode (each with scheduler/detokenizer), router
        (c,) = canary.mint(random.Random(5))
        text = probe.prompt(random.Random(5), 200, [c])
        r = httpx.post(urls["router"] + "/generate", timeout=60, json={
            "text": text, "sampling_params": {"max_new_tokens": probe.max_new_tokens(1), "temperature": 0}})
        assert r.status_code == 200 and canary.payload(c) in r.json()["text"], r.text  # the probe model recites it
        for role in ("prefill", "decode"):
            assert httpx.get(urls[role] + "/health", timeout=10).status_code == 200
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in its terminal
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out
        assert '"router": "' + urls["router"] in out and "attach with --kvchaos-attach" in out
        assert "leftover processes: none" in out, out[-2000:]
        time.sleep(0.5)
        alive = [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"left running after Ctrl-C: {alive}"
        assert (tmp_path / "r").is_dir() and any((tmp_path / "r").glob("up-*/logs/*.log"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

"""``single_server_reference`` (Differential's reference) against a stand-in server: it sends as many
prompts at a time as it is told, and its replies are only kept when the server says nothing was
retracted while they were served; otherwise, or when the server has no metrics, each prompt is served
again alone."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from kvchaos.schedule import single_server_reference


class Stand:
    """``/generate`` answers ``<prompt>!`` after 0.3 s; ``/metrics`` reports a retraction counter that
    grows by ``retract_per_batch`` whenever a request overlapped another (None: no /metrics)."""

    def __init__(self, retract_per_batch=0, metrics=True):
        self.inflight = self.peak = self.served = 0
        self.retracted = 0
        self.lock = threading.Lock()
        stand = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path != "/metrics" or not metrics:
                    self.send_response(404)
                    self.end_headers()
                    return
                body = ("# TYPE sglang:num_retracted_requests_total counter\n"
                        f"sglang:num_retracted_requests_total {stand.retracted}\n").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stand.lock:
                    stand.inflight += 1
                    stand.peak = max(stand.peak, stand.inflight)
                    if stand.inflight > 1:
                        stand.retracted += retract_per_batch
                time.sleep(0.3)
                with stand.lock:
                    stand.inflight -= 1
                    stand.served += 1
                body = json.dumps({"text": req["text"] + "!", "max": req["sampling_params"]["max_new_tokens"]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.endpoints = SimpleNamespace(router=f"http://127.0.0.1:{self.httpd.server_address[1]}")
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stand(request):
    s = Stand(**getattr(request, "param", {}))
    yield s
    s.close()


PLANS = [SimpleNamespace(rid=f"r{i}", prompt=f"p{i}", max_new_tokens=10 + i) for i in range(6)]
WANT = {p.rid: {"text": p.prompt + "!", "max": p.max_new_tokens} for p in PLANS}


def test_alone_by_default(stand):
    assert single_server_reference(stand, PLANS)(None) == WANT
    assert stand.peak == 1 and stand.served == 6


def test_several_at_a_time_when_told_and_nothing_was_retracted(stand):
    ref = single_server_reference(stand, PLANS, concurrency=3)
    assert ref.rids == [p.rid for p in PLANS]
    assert ref(None) == WANT
    assert stand.peak == 3 and stand.served == 6


@pytest.mark.parametrize("stand", [{"retract_per_batch": 1}], indirect=True)
def test_a_retraction_while_serving_several_serves_each_again_alone(stand):
    assert single_server_reference(stand, PLANS, concurrency=3)(None) == WANT
    assert stand.retracted > 0 and stand.served == 12  # 6 side by side, then 6 alone


@pytest.mark.parametrize("stand", [{"metrics": False}], indirect=True)
def test_a_server_without_metrics_serves_each_alone(stand):
    assert single_server_reference(stand, PLANS, concurrency=3)(None) == WANT
    assert stand.peak == 1 and stand.served == 6


def test_bad_concurrency_is_refused():
    with pytest.raises(ValueError, match="concurrency must be >= 1, got 0"):
        single_server_reference(SimpleNamespace(endpoints=SimpleNamespace(router="http://x")), PLANS, concurrency=0)

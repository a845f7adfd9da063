"""``single_server_reference`` (Differential's reference) against a stand-in server: it sends as many
prompts at a time as it is told, and keeps a reply served beside others only when the engine's own
``meta_info.num_retractions`` says 0; a reply retracted, or one that does not say, is served again alone."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from kvchaos.schedule import single_server_reference


class Stand:
    """``/generate`` answers ``<prompt>!`` after 0.3 s. ``meta``: "count" (num_retractions: 0), "retract"
    (1 for a request that overlapped another, else 0), "none" (no num_retractions in meta_info)."""

    def __init__(self, meta="count"):
        self.inflight = self.peak = self.served = 0
        self.alone = []
        self.lock = threading.Lock()
        stand = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stand.lock:
                    stand.inflight += 1
                    stand.peak = max(stand.peak, stand.inflight)
                    crowded = stand.inflight > 1
                time.sleep(0.3)
                with stand.lock:
                    crowded = crowded or stand.inflight > 1
                    stand.inflight -= 1
                    stand.served += 1
                    if not crowded:
                        stand.alone.append(req["text"])
                info = {} if meta == "none" else {"num_retractions": int(crowded and meta == "retract")}
                body = json.dumps({"text": req["text"] + "!", "max": req["sampling_params"]["max_new_tokens"],
                                   "meta_info": info}).encode()
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


def texts(out):
    return {rid: (r["text"], r["max"]) for rid, r in out.items()}


WANT = {p.rid: (p.prompt + "!", p.max_new_tokens) for p in PLANS}


def test_alone_by_default(stand):
    assert texts(single_server_reference(stand, PLANS)(None)) == WANT
    assert stand.peak == 1 and stand.served == 6


def test_several_at_a_time_when_told_and_none_was_retracted(stand):
    ref = single_server_reference(stand, PLANS, concurrency=3)
    assert ref.rids == [p.rid for p in PLANS]
    out = ref(None)
    assert texts(out) == WANT and all(r["meta_info"]["num_retractions"] == 0 for r in out.values())
    assert stand.peak == 3 and stand.served == 6


@pytest.mark.parametrize("stand", [{"meta": "retract"}], indirect=True)
def test_a_reply_retracted_beside_others_is_served_again_alone(stand):
    out = single_server_reference(stand, PLANS, concurrency=3)(None)
    # every reply kept was served uncrowded (the stand says 0 only then), and some had to be served again
    assert texts(out) == WANT and all(r["meta_info"]["num_retractions"] == 0 for r in out.values())
    assert stand.peak == 3 and stand.served > 6


@pytest.mark.parametrize("stand", [{"meta": "none"}], indirect=True)
def test_a_reply_that_does_not_say_is_served_again_alone(stand):
    assert texts(single_server_reference(stand, PLANS, concurrency=3)(None)) == WANT
    assert stand.served == 12 and set(stand.alone) == {p.prompt for p in PLANS}


def test_bad_concurrency_is_refused():
    with pytest.raises(ValueError, match="concurrency must be >= 1, got 0"):
        single_server_reference(SimpleNamespace(endpoints=SimpleNamespace(router="http://x")), PLANS, concurrency=0)

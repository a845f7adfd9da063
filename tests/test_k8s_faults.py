"""Process faults through Kubernetes (faults/k8s.py), against a local stand-in of the API server: the
official client's real requests (list / read / delete pods, Chaos Mesh PodChaos objects) over HTTP to
an in-process server that plays the API and a controller (a deleted pod is replaced, Ready, under a
new uid). Exec (SIGSTOP / SIGCONT of the container's PID 1) is a websocket upgrade: a recorded
stand-in function. A real cluster: docs/kubernetes/."""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

kubernetes = pytest.importorskip("kubernetes")

from faults.base import FaultDidNotFire  # noqa: E402
from faults.k8s import KubernetesProcessFaults, _labels  # noqa: E402

NS = "llm"


class FakeAPI:
    """Pods of two roles; deleting one (or a pod-kill PodChaos) makes the 'controller' start a
    replacement after ``replace_after`` list calls (never, with None)."""

    def __init__(self, replace_after=1):
        self.pods, self.calls, self.chaos = {}, [], {}
        self.replace_after, self.pending = replace_after, []
        self.lock = threading.Lock()
        for role, n in (("prefill", 2), ("decode", 1)):
            for i in range(n):
                self._add(role, f"{role}-{i}")

    def _add(self, role, name):
        self.pods[name] = {"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"name": name, "namespace": NS, "uid": str(uuid.uuid4()),
                                        "labels": {"app": f"sglang-{role}"}},
                           "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}

    def _delete(self, name):
        pod = self.pods.pop(name)
        if self.replace_after is not None:
            self.pending.append([self.replace_after, pod["metadata"]["labels"]["app"][len("sglang-"):], name + "-r"])
        return pod

    def handle(self, method, path, query, body):
        with self.lock:
            self.calls.append((method, path, query.get("labelSelector", [None])[0]))
            parts = path.strip("/").split("/")
            if parts[:4] == ["api", "v1", "namespaces", NS] and parts[4] == "pods":
                if len(parts) == 5 and method == "GET":
                    for p in self.pending:
                        p[0] -= 1
                    for p in [p for p in self.pending if p[0] < 0]:
                        self.pending.remove(p)
                        self._add(p[1], p[2])
                    k, v = query["labelSelector"][0].split("=")
                    items = [p for p in self.pods.values() if p["metadata"]["labels"].get(k) == v]
                    return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
                name = parts[5]
                if name not in self.pods:
                    return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                 "code": 404, "message": f'pods "{name}" not found'}
                if method == "GET":
                    return 200, self.pods[name]
                if method == "DELETE":
                    return 200, self._delete(name)
            if parts[:6] == ["apis", "chaos-mesh.org", "v1alpha1", "namespaces", NS, "podchaos"]:
                if method == "POST":
                    self.chaos[body["metadata"]["name"]] = body
                    sel = body["spec"]["selector"]["labelSelectors"]
                    for n in [n for n, p in self.pods.items()
                              if all(p["metadata"]["labels"].get(k) == v for k, v in sel.items())]:
                        self._delete(n)  # Chaos Mesh's controller acting on the object
                    return 201, body
                if method == "DELETE":
                    return 200, self.chaos.pop(parts[6])
            return 404, {"kind": "Status", "code": 404, "message": f"no route {method} {path}"}


@pytest.fixture
def api():
    fake = FakeAPI()

    class H(BaseHTTPRequestHandler):
        def _do(self):
            u = urlsplit(self.path)
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            code, out = fake.handle(self.command, u.path, parse_qs(u.query), body)
            data = json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _do

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    conf = kubernetes.client.Configuration(host=f"http://127.0.0.1:{srv.server_address[1]}")
    client = kubernetes.client.ApiClient(conf)
    fake.core, fake.custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    yield fake
    srv.shutdown()


SEL = {"prefill": "app=sglang-prefill", "decode": "app=sglang-decode"}


def _kit(api, **kw):
    return KubernetesProcessFaults(NS, SEL, core=api.core, custom=api.custom, poll_s=0.01, timeout_s=5, **kw)


@pytest.mark.parametrize("chaos_mesh", [False, True])
def test_kill_deletes_the_roles_pods_and_heal_waits_for_their_replacements(api, chaos_mesh):
    kit = _kit(api, chaos_mesh=chaos_mesh)
    before = kit.pods("prefill")
    f = kit.kill("prefill")
    ev = f.verify()
    assert sorted(ev["pods"]) == sorted(before) and kit.armed() == ["pod-kill:prefill"]
    assert kit.pods("decode") and "decode-0" in api.pods  # only the role's pods
    if chaos_mesh:
        (obj,) = api.chaos.values()
        assert obj["spec"] == {"action": "pod-kill", "mode": "all", "gracePeriod": 0,
                               "selector": {"namespaces": [NS], "labelSelectors": {"app": "sglang-prefill"}}}
        assert not any(c[0] == "DELETE" and "/pods/" in c[1] for c in api.calls)  # Chaos Mesh killed them
    else:
        assert sorted(c[1].rsplit("/", 1)[1] for c in api.calls if c[0] == "DELETE") == sorted(before)
    rec = kit.restart("prefill")
    assert sorted(rec["replaced_by"]) == ["prefill-0-r", "prefill-1-r"] and kit.armed() == []
    assert api.chaos == {}  # the PodChaos object is gone with the heal


def test_a_role_that_never_comes_back_is_named_within_the_bound(api):
    api.replace_after = None
    kit = _kit(api)
    kit.kill("decode")
    with pytest.raises(FaultDidNotFire, match=r"namespace llm role decode \(app=sglang-decode\): 0/1 replacement"):
        kit.heal_all()


def test_stop_and_cont_signal_pid_1_of_each_pod(api):
    calls, state = [], {}

    def exec_fn(pod, argv):
        calls.append((pod, argv))
        if argv[:2] == ["kill", "-STOP"]:
            state[pod] = "T"
        elif argv[:2] == ["kill", "-CONT"]:
            state[pod] = "S"
        return f"1 (python3) {state.get(pod, 'S')} 0 1 1 0"

    kit = _kit(api, exec_fn=exec_fn)
    f = kit.stop("prefill")
    assert f.verify()["observed"] == {"prefill-0": "T", "prefill-1": "T"}
    kit.cont("prefill")
    assert calls[-2:] == [("prefill-0", ["kill", "-CONT", "1"]), ("prefill-1", ["kill", "-CONT", "1"])]
    assert kit.armed() == []
    with pytest.raises(FaultDidNotFire, match="PID 1 states"):  # a container whose PID 1 ignores it
        _kit(api, exec_fn=lambda pod, argv: "1 (sh) S 0").stop("decode")


def test_bad_input_is_named(api):
    with pytest.raises(ValueError, match="a label selector per role"):
        KubernetesProcessFaults(NS, {"prefill": ""}, core=api.core)
    with pytest.raises(ValueError, match="unknown role 'router'"):
        _kit(api).kill("router")
    with pytest.raises(ValueError, match="only equality terms"):
        _labels("app in (a,b)")
    api.pods.clear()
    with pytest.raises(FaultDidNotFire, match="no Running pod"):
        _kit(api).kill("prefill")


def test_an_attached_cluster_takes_its_process_faults_from_the_environment(api, monkeypatch):
    import faults
    import faults.k8s as k8s

    assert faults.k8s_from_env(env={}) is None
    for env, why in (({"KVCHAOS_K8S_NAMESPACE": NS}, "a selector for prefill and decode"),
                     ({"KVCHAOS_K8S_NAMESPACE": NS, "KVCHAOS_K8S_SELECTORS": "prefill=app=x"}, "expected prefill:")):
        with pytest.raises(ValueError, match=why):
            faults.k8s_from_env(env=env)
    made = {}
    monkeypatch.setattr(k8s, "KubernetesProcessFaults", lambda ns, sel, **kw: made.update(ns=ns, sel=sel, **kw) or "kit")
    env = {"KVCHAOS_K8S_NAMESPACE": NS, "KVCHAOS_K8S_SELECTORS": "prefill:app=sglang-prefill;decode:app=sglang-decode",
           "KVCHAOS_K8S_CHAOS_MESH": "1"}
    assert faults.k8s_from_env(env=env) == "kit"
    assert made == {"ns": NS, "sel": SEL, "log": None, "chaos_mesh": True}

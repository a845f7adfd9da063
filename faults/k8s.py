"""Process faults through the cluster manager: Kubernetes (the official ``kubernetes`` client).

The same interface as :class:`faults.process.ProcessFaults` (the local one, which signals the pids it
started) — ``kill(role)``, ``stop(role)``, ``cont(role)``, ``restart(role)``, ``armed()``,
``heal_all()``, and handles that answer ``verify()`` / ``heal()`` — for engines kvchaos did not start:
a role is the pods a label selector picks (``{"prefill": "app=sglang-prefill", ...}``) in one namespace.

* ``kill``: every Running pod of the role deleted with grace 0 (what a node loss or an OOM kill does
  to the pod); or, with ``chaos_mesh=True``, a Chaos Mesh ``PodChaos`` (action ``pod-kill``) doing
  it. Proof: each deleted pod is gone (404, or its name now carries another uid). Heal: wait until the
  role's controller (Deployment, StatefulSet, LeaderWorkerSet, RoleBasedGroup) has as many Ready pods
  as before, under new uids; the PodChaos is deleted.
* ``stop`` / ``cont``: ``kill -STOP 1`` / ``kill -CONT 1`` exec'd in each pod's container (the engine
  is the container's PID 1): alive, sockets open, answering nothing. Proof: ``/proc/1/stat`` state T.

Every bound is explicit (``timeout_s``); every error names namespace, role and pod. The API is
reached through ``core`` (``CoreV1Api``), ``custom`` (``CustomObjectsApi``) and ``exec_fn(pod, argv)``
— defaults built from the kube config (in-cluster, or ``~/.kube/config``); tests give a local API
stand-in (tests/test_k8s_faults.py). Manifests for a real cluster: docs/kubernetes/.
"""

from __future__ import annotations

import time
import uuid

from .base import Fault, FaultDidNotFire

CHAOS = ("chaos-mesh.org", "v1alpha1", "podchaos")


class K8sFault(Fault):
    injector = "k8s"

    def __init__(self, owner: "KubernetesProcessFaults", role: str, kind: str, pods: dict, record: dict,
                 chaos: str | None = None):
        self.owner, self.role, self.kind = owner, role, kind
        self.pods = dict(pods)  # name -> uid (kill) / state seen (stop)
        self.record, self.chaos = record, chaos
        self.id = f"{kind}-{role}-{uuid.uuid4().hex[:8]}"
        self.healed, self.heal_record = False, None

    def fired_events(self) -> list[dict]:
        return [dict(self.record)] if self.record.get("acted") else []

    def verify(self) -> dict:
        if not self.record.get("acted"):
            raise FaultDidNotFire(f"{self.kind} {self.owner.where(self.role)}: {self.record.get('observed')}")
        return {"id": self.id, **self.record}

    def heal(self):
        if not self.healed:
            self.owner._heal(self)
        return self.heal_record


class RoleFaults:
    """What the process injectors share (this one and the local :class:`faults.process.ProcessFaults`,
    which imports it from here: this module stays free of ``kvchaos.cluster``): the handles they made
    (``faults``), the ``fault`` events they write to ``log``, and a role's open handles."""

    injector = ""
    log = None
    faults: list

    def _scope(self) -> dict:
        """Fields every event of this injector carries (after ``injector``)."""
        return {}

    def _emit(self, **f) -> dict:
        rec = {"injector": self.injector, **self._scope(), **f}
        if self.log is not None:
            self.log.emit("fault", **rec)
        return rec

    def _open(self, role: str, kind: str) -> list:
        return [f for f in self.faults if f.role == role and f.kind == kind and not f.healed]

    def _made(self, f, failure: str | None = None):
        """Keep the handle ``f`` (``heal_all`` heals it, fired or not) and return it; when the fault
        did not act (``failure``: what was seen) raise :class:`FaultDidNotFire` with that instead."""
        self.faults.append(f)
        if failure:
            raise FaultDidNotFire(failure)
        return f


class KubernetesProcessFaults(RoleFaults):
    injector = "k8s"

    def __init__(self, namespace: str, selectors: dict[str, str], log=None, core=None, custom=None, exec_fn=None,
                 chaos_mesh: bool = False, timeout_s: float = 300.0, poll_s: float = 1.0, container: str | None = None):
        if not namespace or not selectors or not all(isinstance(v, str) and v for v in selectors.values()):
            raise ValueError("kubernetes process faults need a namespace and a label selector per role, "
                             "e.g. {'prefill': 'app=sglang-prefill', 'decode': 'app=sglang-decode'}")
        if core is None or (chaos_mesh and custom is None):
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            core = core or client.CoreV1Api()
            custom = custom or client.CustomObjectsApi()
        self.ns, self.selectors, self.log = namespace, dict(selectors), log
        self.core, self.custom, self.chaos_mesh = core, custom, chaos_mesh
        self.exec_fn = exec_fn or self._exec
        self.timeout_s, self.poll_s, self.container = timeout_s, poll_s, container
        self.faults: list[K8sFault] = []

    # ------------------------------------------------------------------ helpers
    def where(self, role: str, pod: str | None = None) -> str:
        return f"namespace {self.ns} role {role} ({self.selectors.get(role)})" + (f" pod {pod}" if pod else "")

    def pods(self, role: str, ready_only: bool = False) -> dict[str, str]:
        """Running pods of ``role``: name -> uid (``ready_only``: those whose Ready condition is True)."""
        if role not in self.selectors:
            raise ValueError(f"unknown role {role!r}; one of {sorted(self.selectors)}")
        got = self.core.list_namespaced_pod(self.ns, label_selector=self.selectors[role])
        out = {}
        for p in got.items:
            if p.metadata.deletion_timestamp is not None or (p.status.phase or "") != "Running":
                continue
            if ready_only and not any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or [])):
                continue
            out[p.metadata.name] = p.metadata.uid
        return out

    def _gone(self, name: str, uid: str) -> bool:
        from kubernetes.client.rest import ApiException

        try:
            p = self.core.read_namespaced_pod(name, self.ns)
        except ApiException as e:
            if e.status == 404:
                return True
            raise
        return p.metadata.uid != uid

    def _exec(self, pod: str, argv: list[str]) -> str:
        from kubernetes.stream import stream

        kw = {"container": self.container} if self.container else {}
        return stream(self.core.connect_get_namespaced_pod_exec, pod, self.ns, command=argv, stderr=True,
                      stdin=False, stdout=True, tty=False, **kw)

    def _scope(self) -> dict:
        return {"namespace": self.ns}

    # ------------------------------------------------------------------ faults
    def kill(self, role: str) -> K8sFault:
        pods = self.pods(role)
        if not pods:
            raise FaultDidNotFire(f"kill {self.where(role)}: no Running pod")
        t, chaos = time.time(), None
        if self.chaos_mesh:
            chaos = f"kvchaos-kill-{role}-{uuid.uuid4().hex[:6]}"
            group, version, plural = CHAOS
            self.custom.create_namespaced_custom_object(group, version, self.ns, plural, {
                "apiVersion": f"{group}/{version}", "kind": "PodChaos",
                "metadata": {"name": chaos, "namespace": self.ns, "labels": {"app.kubernetes.io/managed-by": "kvchaos"}},
                "spec": {"action": "pod-kill", "mode": "all", "gracePeriod": 0,
                         "selector": {"namespaces": [self.ns], "labelSelectors": _labels(self.selectors[role])}}})
        else:
            for name in pods:
                self.core.delete_namespaced_pod(name, self.ns, grace_period_seconds=0)
        deadline = time.monotonic() + self.timeout_s
        left = dict(pods)
        while left and time.monotonic() < deadline:
            left = {n: u for n, u in left.items() if not self._gone(n, u)}
            if left:
                time.sleep(self.poll_s)
        rec = self._emit(action="fired", kind="pod-kill", role=role, pods=sorted(pods), at=t, chaos=chaos,
                         acted=not left, observed={"still_there": sorted(left)})
        failure = f"kill {self.where(role)}: pods {sorted(left)} still there after {self.timeout_s} s" if left else None
        return self._made(K8sFault(self, role, "pod-kill", pods, rec, chaos), failure)

    def stop(self, role: str) -> K8sFault:
        pods = self.pods(role)
        if not pods:
            raise FaultDidNotFire(f"stop {self.where(role)}: no Running pod")
        states = {}
        for name in pods:
            self.exec_fn(name, ["kill", "-STOP", "1"])
            states[name] = _proc_state(self.exec_fn(name, ["cat", "/proc/1/stat"]))
        acted = all(s in ("T", "t") for s in states.values())
        rec = self._emit(action="fired", kind="sigstop", role=role, pods=sorted(pods), at=time.time(), acted=acted,
                         observed=states)
        return self._made(K8sFault(self, role, "sigstop", states, rec),
                          None if acted else f"stop {self.where(role)}: PID 1 states {states}")

    def _heal(self, f: K8sFault) -> None:
        if f.kind == "sigstop":
            for name in f.pods:
                self.exec_fn(name, ["kill", "-CONT", "1"])
            f.heal_record = {"resumed": sorted(f.pods)}
        else:
            if f.chaos:
                group, version, plural = CHAOS
                self.custom.delete_namespaced_custom_object(group, version, self.ns, plural, f.chaos)
            want, deadline = len(f.pods), time.monotonic() + self.timeout_s
            ready = {}
            while time.monotonic() < deadline:
                ready = {n: u for n, u in self.pods(f.role, ready_only=True).items() if u not in f.pods.values()}
                if len(ready) >= want:
                    break
                time.sleep(self.poll_s)
            if len(ready) < want:
                raise FaultDidNotFire(f"heal {self.where(f.role)}: {len(ready)}/{want} replacement pods Ready after "
                                      f"{self.timeout_s} s")
            f.heal_record = {"replaced_by": sorted(ready)}
        f.healed = True
        self._emit(action="healed", kind=f.kind, role=f.role, **f.heal_record)

    def cont(self, role: str) -> None:
        for f in self._open(role, "sigstop"):
            self._heal(f)

    def restart(self, role: str) -> dict:
        """Wait for ``role``'s killed pods to be replaced (its controller restarts them)."""
        out = {}
        for f in self._open(role, "pod-kill"):
            self._heal(f)
            out = f.heal_record
        return out

    def armed(self) -> list[str]:
        return [f"{f.kind}:{f.role}" for f in self.faults if not f.healed]

    def heal_all(self) -> None:
        for f in list(self.faults):
            if not f.healed:
                self._heal(f)


def _labels(selector: str) -> dict[str, str]:
    """``a=b,c=d`` -> {"a": "b", "c": "d"} (Chaos Mesh's labelSelectors); set-based selectors are refused."""
    out = {}
    for part in filter(None, (x.strip() for x in selector.split(","))):
        k, eq, v = part.partition("=")
        if not eq or not k or v.startswith("=") or any(c in part for c in "!()"):
            raise ValueError(f"label selector {selector!r}: only equality terms (a=b,c=d) can be a Chaos Mesh selector")
        out[k] = v
    return out


def _proc_state(stat: str) -> str | None:
    try:
        return stat.rsplit(")", 1)[1].split()[0]
    except (IndexError, AttributeError):
        return None

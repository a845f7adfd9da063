"""What a finding's signature may look at besides the verdict (:class:`Context`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvchaos.history import History, as_history


@dataclass
class Context:
    """What a signature may look at besides the verdict: the experiment's history (its header says
    which engine ran) and the known engine failures found in the servers' logs during it."""
    history: History = None
    engine: str = "sglang"
    version: str | None = None
    engine_errors: list = field(default_factory=list)
    registry: object = None  # the canary registry the checkers were handed (kvchaos.canary.Registry)

    def __post_init__(self):
        if self.history is not None and not isinstance(self.history, History):
            self.history = as_history(self.history)  # records given: indexed once, here

    @classmethod
    def of(cls, events, engine_errors=(), registry=None) -> "Context":
        h = as_history(events)
        eng = h.header.get("engine") or {}
        ver = eng.get("version")
        if isinstance(ver, (int, float)) and not isinstance(ver, bool):
            ver = str(ver)  # a number in the header's JSON is the version it spells
        elif not isinstance(ver, str):
            ver = None  # an object, a list, a bool: no version is named (no finding applies)
        return cls(h, eng.get("name") or "sglang", ver, list(engine_errors), registry)

    @property
    def events(self) -> list[dict]:
        return self.history.records if self.history is not None else []

    def plans(self) -> dict[str, dict]:
        return self.history.plans if self.history is not None else {}

    def fault_events(self, action: str | None = None) -> list[dict]:
        """Fault records of the experiment: the harness's ``fault`` events and the agents' own
        ``fault_fired`` (copied into the log as ``agent``), the latter as action ``fired``."""
        if self.history is None:
            return []
        out = [e for e in self.history.fault_records(action)]
        if action in (None, "fired"):
            out += [{**e, "action": "fired"} for e in self.history.agent_events("fault_fired")]
        return out


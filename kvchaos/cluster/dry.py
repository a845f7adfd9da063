"""The stand-in cluster of a dry run (``--kvchaos-dry``): it knows its spec and nothing else. A
dry run records each experiment's plans and sends nothing; a test that needs a live engine before
its first experiment (a server's answer, metrics, endpoints) stops there and says so."""

from __future__ import annotations


class DryRun(Exception):
    """A dry run stopped here: the experiment's plans were recorded, or the test needed a live engine
    before its first experiment. The pytest plugin reports it as skipped, with this message."""


class NeedsEngine(DryRun, AttributeError):
    """A dry run's cluster was asked for something only a live engine has. An AttributeError too, so
    capability probes (``hasattr(cluster, "restart")``) read it as absent."""


class DryCluster:
    def __init__(self, spec):
        self.spec = spec
        self.agent_dir = None
        self.proxy = None
        self.selftest = None
        self.leak_sensitive = None

    def check_alive(self) -> None:
        return None

    def engine_errors(self) -> list:
        return []

    def stop(self) -> list:
        return []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NeedsEngine(f"dry run: this test needs a live engine before its first experiment (cluster.{name}); "
                     "no plans recorded")


class DryFaults:
    """The fault kit of a dry run: nothing is armed (the experiment stops on entering, before the
    body that arms its faults runs); an injector asked for before that is a stand-in too, and
    anything else needs a live engine."""

    log = None

    def need(self, what: str) -> "DryFaults":
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NeedsEngine(f"dry run: this test uses faults.{name} before its first experiment; no plans recorded")

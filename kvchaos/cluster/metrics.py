"""Read SGLang's Prometheus ``/metrics`` (servers run with ``--enable-metrics``)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvchaos import httpclient


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple
    value: float


class Metrics:
    def __init__(self, samples: list[Sample], families: set | None = None):
        self.samples = samples
        self.families = set(families or ())  # declared metric families, with or without samples yet

    @classmethod
    def parse(cls, text: str) -> "Metrics":
        out, fams = [], set()
        for fam in text_string_to_metric_families(text):
            fams.add(fam.name)
            for s in fam.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out.append(Sample(s.name, labels, float(s.value)))
        return cls(out, fams)

    def declares(self, name: str) -> bool:
        """Whether the server exports ``name`` at all (a labelled counter has no sample until its
        first increment, but its family is declared from the start)."""
        return (name in self.families or name.removesuffix("_total") in self.families
                or any(s.name == name for s in self.samples))

    @classmethod
    def fetch(cls, base_url: str, timeout: float = 10.0) -> "Metrics":
        r = httpclient.get(f"{base_url}/metrics", timeout=timeout)
        r.raise_for_status()
        return cls.parse(r.text)

    def value(self, name: str, **labels) -> float:
        """Sum of samples named ``name`` whose labels include ``labels`` (0.0 if none)."""
        want = set(labels.items())
        return sum(s.value for s in self.samples if s.name == name and want <= set(s.labels))

    def delta(self, before: "Metrics", name: str, **labels) -> float:
        return self.value(name, **labels) - before.value(name, **labels)

"""The corpus: scenarios that showed the engines doing something new, kept between runs.

A directory (``--corpus DIR``; a fresh one under the run's reports otherwise):

    entries/<digest>.json   {"scenario": {...}, "features": [...], "new": [...], "added_at_s": ..., "run": ...}
    seen.json               every feature seen so far (the union), and when each was first seen

An entry joins when its run showed at least one feature not in ``seen``. :meth:`Corpus.pick` favours
entries that brought many new features and have been picked less (AFL's favoured entries, simply).
Opening an existing directory resumes it: its entries and features are loaded, and a damaged file is
refused by name, never skipped.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvchaos.workload.scenario import Scenario, ScenarioError


class CorpusError(ValueError):
    pass


class Corpus:
    def __init__(self, path):
        self.dir = Path(path)
        self.entries: dict[str, dict] = {}
        self.seen: dict[str, dict] = {}
        self.picks: dict[str, int] = {}
        self.resumed = False
        (self.dir / "entries").mkdir(parents=True, exist_ok=True)
        self._load()

    def _load(self) -> None:
        seen = self.dir / "seen.json"
        if seen.exists():
            try:
                self.seen = json.loads(seen.read_text())
            except json.JSONDecodeError as e:
                raise CorpusError(f"{seen}: not JSON ({e}): the corpus cannot be resumed") from None
            if not isinstance(self.seen, dict):
                raise CorpusError(f"{seen}: expected an object of features")
        for f in sorted((self.dir / "entries").glob("*.json")):
            try:
                d = json.loads(f.read_text())
                Scenario.from_dict(d["scenario"])
            except (json.JSONDecodeError, KeyError, ScenarioError) as e:
                raise CorpusError(f"{f}: not a corpus entry ({type(e).__name__}: {e})") from None
            self.entries[f.stem] = d
        self.resumed = bool(self.entries or self.seen)

    def new_features(self, feats) -> list[str]:
        return sorted(f for f in feats if f not in self.seen)

    def add(self, sc: Scenario, feats, at_s: float, run: str = "", force: bool = False) -> bool:
        """Record ``feats`` as seen; keep ``sc`` if it brought a new one (or ``force``: the seeds).
        Returns whether it was kept."""
        new = self.new_features(feats)
        for f in new:
            self.seen[f] = {"first_at_s": round(at_s, 2), "run": run, "by": sc.digest()}
        keep = bool(new) or force
        if keep:
            d = sc.digest()
            self.entries[d] = {"scenario": sc.to_dict(), "features": sorted(feats), "new": new,
                               "added_at_s": round(at_s, 2), "run": run}
            (self.dir / "entries" / f"{d}.json").write_text(json.dumps(self.entries[d], indent=1) + "\n")
        (self.dir / "seen.json").write_text(json.dumps(self.seen, indent=1, sort_keys=True) + "\n")
        return keep

    def pick(self, rng: random.Random) -> Scenario:
        if not self.entries:
            raise CorpusError("the corpus is empty: nothing to mutate")
        keys = sorted(self.entries)
        w = [(1 + len(self.entries[k].get("new", []))) / (1 + self.picks.get(k, 0)) for k in keys]
        k = rng.choices(keys, w)[0]
        self.picks[k] = self.picks.get(k, 0) + 1
        return Scenario.from_dict(self.entries[k]["scenario"])

    def __len__(self) -> int:
        return len(self.entries)

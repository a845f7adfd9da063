"""The corpus: scenarios that showed the engines doing something new, kept between runs.

A directory (``--corpus DIR``; a fresh one under the run's reports otherwise):

    entries/<digest>.json   {"scenario": {...}, "features": [...], "new": [...], "added_at_s": ..., "run": ...}
    seen.json               every feature seen so far (the union), and when each was first seen

An entry joins when its run showed at least one feature not in ``seen``. :meth:`Corpus.pick` favours
entries that brought many new features, have been picked less, and ran fast (AFL's favoured entries,
simply: an entry whose run took k times the corpus's median is picked about 1/k as often; on these
machines a scenario that hangs requests into their timeouts or kills a transfer thread costs minutes,
and a first 30-minute search spent most of its budget mutating one such family).
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

    def add(self, sc: Scenario, feats, at_s: float, run: str = "", force: bool = False,
            wall_s: float | None = None) -> bool:
        """Record ``feats`` as seen; keep ``sc`` if it brought a new one (or ``force``: the seeds);
        ``wall_s``: how long its run took. Returns whether it was kept."""
        new = self.new_features(feats)
        for f in new:
            self.seen[f] = {"first_at_s": round(at_s, 2), "run": run, "by": sc.digest()}
        keep = bool(new) or force
        if keep:
            d = sc.digest()
            self.entries[d] = {"scenario": sc.to_dict(), "features": sorted(feats), "new": new,
                               "added_at_s": round(at_s, 2), "run": run,
                               "wall_s": None if wall_s is None else round(wall_s, 1)}
            (self.dir / "entries" / f"{d}.json").write_text(json.dumps(self.entries[d], indent=1) + "\n")
        (self.dir / "seen.json").write_text(json.dumps(self.seen, indent=1, sort_keys=True) + "\n")
        return keep

    def pick(self, rng: random.Random) -> Scenario:
        if not self.entries:
            raise CorpusError("the corpus is empty: nothing to mutate")
        keys = sorted(self.entries)
        walls = sorted(x for x in (self.entries[k].get("wall_s") for k in keys) if x)
        ref = walls[(len(walls) - 1) // 2] if walls else None  # the lower median

        def speed(k):
            x = self.entries[k].get("wall_s")
            return 1.0 if not (ref and x) else min(1.0, ref / x)
        w = [(1 + len(self.entries[k].get("new", []))) / (1 + self.picks.get(k, 0)) * speed(k) for k in keys]
        k = rng.choices(keys, w)[0]
        self.picks[k] = self.picks.get(k, 0) + 1
        return Scenario.from_dict(self.entries[k]["scenario"])

    def __len__(self) -> int:
        return len(self.entries)

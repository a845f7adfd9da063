"""README and docs figures come from committed artifacts: this script renders each one between its markers

    <!-- figure:NAME -->
    ...generated...
    <!-- /figure:NAME -->

from the files named in FIGURES, on the page HOMES names, and with ``--check`` exits 1 (printing the
difference) when a page does not say what the artifacts say. tests/test_readme_figures.py runs the check.

    python scripts/readme_figures.py           # rewrite the figures
    python scripts/readme_figures.py --check   # verify them
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREFIX = REPO / "reports" / "incidents" / "glm53-prefix" / "verdicts.json"
REPLAY = REPO / "reports" / "incidents" / "glm53-replay" / "verdicts.json"
MATRIX = REPO / "reports" / "matrix" / "detection_matrix.json"
FINDINGS = REPO / "kvchaos" / "findings.toml"
RELEASES = REPO / "reports" / "releases" / "release_table.json"


def _load(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"readme_figures: cannot read {p.relative_to(REPO)}: {e}") from None


def glm53_witness() -> str:
    iso = next(v for v in _load(PREFIX) if v["oracle"] == "isolation")
    w = iso["witnesses"][0]
    keep = ("victim_rid", "victim_tenant", "owner_rid", "owner_tenant", "canary", "matched", "status", "excerpt")
    body = json.dumps({k: (w[k].splitlines()[0] if k == "excerpt" else w[k]) for k in keep if k in w})
    return f"```json\n{body}\n```\n(first isolation witness in `{PREFIX.relative_to(REPO)}`; excerpt: its first line)"


def replay_verdicts() -> str:
    rows = [f"{v['oracle']:15s} {v['status'].upper():5s} {v['summary']}" for v in _load(REPLAY)]
    return "```\n" + "\n".join(rows) + f"\n```\n(from `{REPLAY.relative_to(REPO)}`)"


def replay_witness() -> str:
    iso = next(v for v in _load(REPLAY) if v["oracle"] == "isolation")
    w = iso["witnesses"][0]
    plans = {}
    for line in REPLAY.with_name("events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("ev") == "plan":
            plans[e["rid"]] = e
    own = plans.get(w["victim_rid"], {}).get("canaries", [])
    return (f"```\n{w['victim_rid']} (tenant {w['victim_tenant']}, HTTP {w['status']}) received "
            f"{w['matched']} of {w['owner_rid']} ({w['owner_tenant']})\n"
            f"reply:  {w['excerpt'].splitlines()[0]}\n"
            f"own canaries (none recited): {' '.join(own)}\n```\n"
            f"(first isolation witness in `{REPLAY.relative_to(REPO)}`, canaries from its `events.jsonl`)")


def detection_matrix() -> str:
    rows = _load(MATRIX)
    out = ["| class | arm | detected | witness names the victim | also | "
           "time to first detection | policy per trial |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = f"{r['time_to_first_detection_s']:.1f} s" if r.get("time_to_first_detection_s") is not None else "—"
        if "first_request_caught" in r:
            first = (f"first oversized request caught {r['first_request_caught']}/{r['trials']} (leak shown "
                     f"{r['first_request_leak_shown']}/{r['trials']})")
        elif "positions_caught" in r:
            first = "at its position: " + ", ".join(f"{k} {v}/{r['trials']}" for k, v in r["positions_caught"].items())
        elif "replies_show_it" in r:
            first = f"replies show it {r['replies_show_it']}/{r['trials']} (isolation / differential)"
        else:
            first = "—"
        wit = f"{r['witness_ok']}/{r['detected']}" if r["arm"] == "mutated" else "—"
        out.append(f"| `{r['class']}` | {r['arm']} | {r['detected']}/{r['trials']} | {wit} | {first} | {t} | "
                   f"{', '.join(r.get('judgements', []))} |")
    return "\n".join(out) + f"\n\n(from `{MATRIX.relative_to(REPO)}`)"


def findings() -> str:
    data = tomllib.loads(FINDINGS.read_text())
    out = ["| finding | engine versions | checker (status) | title |", "|---|---|---|---|"]
    for f in data["finding"]:
        # one entry per checker and status: a finding may match the same verdict by more than one signature
        checks = ", ".join(dict.fromkeys(f"{m['checker']} ({'/'.join(m.get('statuses', ['fail']))})"
                                         for m in f["match"]))
        out.append(f"| `{f['id']}` | {f['engine']} {', '.join(f['versions'])} | {checks} | {f['title']} |")
    return "\n".join(out) + f"\n\n(from `{FINDINGS.relative_to(REPO)}`)"


def engine_hunt() -> str:
    """One row per finding reproduced by its committed provoke.py: trials armed and reproduced, the
    control trials and what they showed (``reports/findings/<id>/runs/provoke.json``)."""
    titles = {f["id"]: f["title"] for f in tomllib.loads(FINDINGS.read_text())["finding"]}
    out = ["| target (finding) | trials | reproduced | control trials failing | report |", "|---|---|---|---|---|"]
    for path in sorted((REPO / "reports" / "findings").glob("*/runs/provoke.json")):
        fid = path.parent.parent.name
        r = _load(path)
        armed = [t for t in r["trials"] if t["armed"]]
        control = [t for t in r["trials"] if not t["armed"]]
        failing = r.get("control_failed", r.get("control_died"))
        out.append(f"| {titles.get(fid, '?')} (`{fid}`) | {len(armed)} + {len(control)} control | "
                   f"**{r['reproduced']}/{len(armed)}** | {failing}/{len(control)} | "
                   f"[report](reports/findings/{fid}/README.md) |")
    return "\n".join(out) + "\n\n(from `reports/findings/*/runs/provoke.json`)"


def replay_shrink() -> str:
    """Per committed scenario (``reports/replay-shrink/<name>/``): the reproduction rate of
    ``kvchaos replay`` (replay.json, when there is one), the sizes before / after ``kvchaos shrink``
    (minimal.json), and how often the minimal repro reproduced, each run on a fresh cluster (the last
    line of repro-fresh-cluster.log, ``repro.py --times N``)."""
    out = ["| scenario | `kvchaos replay` | original: requests / tenants / faults / concurrency / prompt chars | "
           "minimal | attempts | minimal failed again | `repro.py`, fresh clusters | report |",
           "|---|---|---|---|---|---|---|---|"]
    for path in sorted((REPO / "reports" / "replay-shrink").glob("*/minimal.json")):
        d = path.parent
        m = _load(path)
        rep = _load(d / "replay.json") if (d / "replay.json").exists() else None
        rate = (f"reproduced **{rep['scenarios'][0]['reproduced']}/{rep['scenarios'][0]['of']}**" if rep else "-")
        log = d / "repro-fresh-cluster.log"
        got = re.search(r"^reproduced (\d+/\d+)", log.read_text(), re.M) if log.exists() else None
        fresh = f"**{got.group(1)}**" if got else "-"
        o, n = m["original"], m["minimal"]
        size = lambda x: (f"{x['requests']} / {x['tenants']} / {x['faults']} / {x['concurrency']} / "  # noqa: E731
                          f"{x.get('prompt_chars', '-')}")
        out.append(f"| `{m['experiment']}` ({m['target']['oracle']} FAIL) | {rate} | {size(o)} | **{size(n)}** | "
                   f"{m['steps']} | {m.get('confirmed')}/{m.get('confirm_runs')} | {fresh} | "
                   f"[BUG.md](reports/replay-shrink/{d.name}/BUG.md) |")
    return "\n".join(out) + ("\n\n(from `reports/replay-shrink/*/minimal.json`, `replay.json` and "
                             "`repro-fresh-cluster.log`)")


def _release_table(path: Path) -> str:
    sys.path.insert(0, str(REPO))
    from kvchaos.releases import render_markdown

    t = _load(path)
    body = render_markdown(t, t.get("command")).split("\n", 2)[2].strip()  # without the title line
    return f"{body}\n\n(from `{path.relative_to(REPO)}`)"


def release_table() -> str:
    return _release_table(RELEASES)


def release_table_auto_truncate() -> str:
    return _release_table(RELEASES.with_name("release_table-auto-truncate.json"))


FIGURES = {"release-table": release_table, "release-table-auto-truncate": release_table_auto_truncate,
           "glm53-witness": glm53_witness, "replay-verdicts": replay_verdicts,
           "replay-witness": replay_witness, "detection-matrix": detection_matrix, "findings": findings,
           "engine-hunt": engine_hunt, "replay-shrink": replay_shrink}


# where each figure lives; figures whose links are relative to the repository root stay in README.md
# (mkdocs --strict refuses links that leave docs/)
HOMES = {
    "glm53-witness": "README.md",
    "findings": "README.md",
    "engine-hunt": "README.md",
    "replay-shrink": "README.md",
    "replay-verdicts": "docs/tutorial/read-a-report.md",
    "replay-witness": "docs/tutorial/read-a-report.md",
    "release-table": "docs/engine/releases.md",
    "release-table-auto-truncate": "docs/engine/releases.md",
    "detection-matrix": "docs/engine/detection-matrix.md",
}


def block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- figure:{name} -->\n)(?:.*?\n)?(<!-- /figure:{name} -->)", re.S)


def render(text: str, names, page: str = "README.md") -> str:
    """``text`` (of ``page``) with the figures ``names`` rendered from the artifacts."""
    for name in names:
        rx = block(name)
        if not rx.search(text):
            raise SystemExit(f"readme_figures: {page} has no <!-- figure:{name} --> ... <!-- /figure:{name} --> block")
        body = FIGURES[name]()
        text = rx.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page's figures differ from the artifacts")
    args = ap.parse_args(argv)
    rc = 0
    for page in sorted(set(HOMES.values())):
        path = REPO / page
        old = path.read_text()
        new = render(old, [n for n, h in HOMES.items() if h == page], page)
        if args.check:
            if new != old:
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), page,
                                                           f"{page} (from artifacts)"))
                rc = 1
        elif new != old:
            path.write_text(new)
    return rc


if __name__ == "__main__":
    sys.exit(main())

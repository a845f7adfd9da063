"""The self-contained ``report.html``: no external file, script or font; plots are inline SVG.

The page leads with the verdict and the findings, in this order (and ``tests/test_report*.py``
find these elements):

1. ``#summary``: the run's status as a big badge (``#verdict``: FAIL / UNKNOWN / KNOWN-only / PASS /
   NO CHAOS VERDICT, ``data-overall``) and a one-line reason (``#reason``), then run, tests, cluster;
2. ``section#leaks``: every leak witness of every experiment that was not planted — per victim a
   ``div.witness.leak`` with the reply as the checker scanned it, the leaked text in ``mark.leak``
   and its own canaries in ``mark.own``; owner (or "unknown origin"), origin, HTTP status, request
   outcome, complete or cut, and the verdict's outcome (red, or the known finding that matched);
   kv_lifecycle / differential FAIL witnesses as ``div.witness.other`` tables;
3. ``section#known``: every KNOWN finding (``div.known-finding``): id, title, upstream links, engine version,
   test, accepted or not, its witnesses;
4. ``section#not-reproduced`` when a listed finding did not reproduce;
5. engine failures, the detection matrix (``table#matrix``), deployment audits;
6. one ``section.scenario`` per experiment (``data-status``: the policy's status, ``data-planted``)
   with ``table.verdicts``, ``figure.timeline svg``, ``figure.latency svg`` and its other witnesses;
   planted experiments are labelled "planted — caught as required" or "planted — MISSED";
7. ``table#tests``: only tests that ran an experiment (under suites/, or named by an experiment
   record); the harness's own tests are one line (``#harness-tests``) with failures named;
8. ``section#logs`` with the tail of every engine log.
"""

from __future__ import annotations

import html
import json
import time

from kvchaos import canary
from kvchaos.history import render_witness
from kvchaos.policy import leak_verdict

from . import plots
from .model import FAILED_TESTS
from .verdicts import known_findings
from .verdicts import leaks as run_leaks

CSS = """
body{font:13px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1180px;color:#222}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 6px;border-bottom:1px solid #ddd;padding-bottom:3px}
h3{font-size:13px;margin:14px 0 4px}
table{border-collapse:collapse;margin:6px 0;width:100%} td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f4} code,pre{font:12px/1.35 ui-monospace,SFMono-Regular,Menlo,monospace}
pre{background:#f7f7f7;padding:6px;overflow-x:auto;white-space:pre-wrap;word-break:break-all;margin:4px 0}
.badge{display:inline-block;padding:1px 7px;border-radius:9px;font-weight:600;font-size:11px;color:#fff}
.pass,.passed{background:#2e7d32}.fail,.failed,.error,.red{background:#c62828}.unknown{background:#8d6e00}
.known{background:#e65100}.xfailed,.skipped,.none,.ok,.xpassed{background:#6d6d6d}
.badge.big{font-size:22px;padding:4px 16px;border-radius:14px;vertical-align:middle}
#reason{font-size:15px;margin:6px 0 4px;font-weight:600}
mark.leak{background:#ffcdd2;color:#b71c1c;font-weight:700;outline:1px solid #c62828}
mark.own{background:#c8e6c9;color:#1b5e20}
.witness{border-left:4px solid #c62828;padding:4px 10px;margin:8px 0;background:#fffafa}
.witness.other{border-left-color:#8d6e00;background:#fffdf5}
.witness.planted-leak{border-left-color:#6d6d6d;background:#fafafa}
.known-finding{border-left:4px solid #e65100;padding:4px 10px;margin:10px 0;background:#fff8f0}
.planted-label{font-weight:700}
figure{margin:8px 0} figure svg{max-width:100%;height:auto}
.muted{color:#666} details{margin:4px 0} summary{cursor:pointer}
"""

MAX_WITNESSES = 40
LABEL = {"fail": "FAIL", "unknown": "UNKNOWN", "known": "KNOWN-only", "pass": "PASS", "none": "NO CHAOS VERDICT"}


def esc(x) -> str:
    return html.escape("" if x is None else str(x))


def badge(status, label: str | None = None, big: bool = False) -> str:
    s = esc(status or "unknown")
    return f'<span class="badge {s}{" big" if big else ""}">{esc(label) if label else s.upper()}</span>'


def highlight(text: str, leaks: list[tuple[int, int, str]], own: list[str]) -> str:
    """``text`` with each leak span (start, end, title) in ``mark.leak`` and own canary payloads in
    ``mark.own``. A span whose offsets do not hold the matched text is located by search instead."""
    spans = []
    for s, e, title, matched in leaks:
        if not (0 <= s < e <= len(text)) or (matched and text[s:e] != matched):
            k = text.find(matched) if matched else -1
            if k < 0:
                continue
            s, e = k, k + len(matched)
        spans.append((s, e, "leak", title))
    for pay in own:
        k = text.find(pay)
        while k >= 0:
            if not any(a < k + len(pay) and k < b for a, b, *_ in spans):
                spans.append((k, k + len(pay), "own", "own canary"))
            k = text.find(pay, k + 1)
    spans.sort()
    out, pos = [], 0
    for s, e, cls, title in spans:
        if s < pos:
            continue
        out.append(esc(text[pos:s]))
        out.append(f'<mark class="{cls}" title="{esc(title)}">{esc(text[s:e])}</mark>')
        pos = e
    out.append(esc(text[pos:]))
    return "".join(out)


def _owner(w: dict) -> str:
    if not w.get("owner_rid") and (w.get("origin") == "unknown" or w.get("match") == "unknown-origin"):
        return "unknown origin"
    return f"{w.get('owner_rid')} ({w.get('owner_tenant')})"


def _complete(w: dict, r) -> str:
    c = w.get("complete")
    if c is None and r is not None:
        c = r.complete
    return "complete" if c in (True, None) else "cut (partial reply)"


def _verdict_outcome(v: dict) -> str:
    k = v.get("known") or {}
    if v.get("outcome") == "known":
        return (badge("known", f"KNOWN {k.get('id')}") + (" accepted" if k.get("accepted") else
                                                          " <b>NOT accepted (red)</b>"))
    if v.get("outcome") == "ok":
        return badge("ok", "as required")
    return badge("red", "RED")


def _isolation_witnesses(scn, v, cls: str = "leak", sid: int | None = None) -> str:
    """One block per victim: the reply exactly as the isolation checker scanned it
    (``oracles.Run.response_text``, so the witness offsets index it), leaked text marked."""
    by_victim: dict = {}
    for w in v.get("witnesses") or []:
        if isinstance(w, dict):
            by_victim.setdefault(w.get("victim_rid"), []).append(w)
    parts = []
    for n, (rid, ws) in enumerate(by_victim.items()):
        if n >= MAX_WITNESSES:
            parts.append(f'<p class="muted">… {len(by_victim) - n} more victims in {esc(scn.source)}</p>')
            break
        r = scn.requests.get(rid)
        w0 = ws[0]
        owners = ", ".join(sorted({_owner(w) for w in ws}))
        origins = ", ".join(sorted({str(w.get("origin") or "this log") for w in ws}))
        head = (f"<b>{esc(rid)}</b> (tenant <b>{esc(w0.get('victim_tenant'))}</b>, HTTP {esc(w0.get('status'))}, "
                f"{esc(w0.get('outcome') or (r.outcome if r else None))}, {esc(_complete(w0, r))}) "
                f"received {len(ws)} canar{'y' if len(ws) == 1 else 'ies'} of {esc(owners)} "
                f"<span class=\"muted\">origin: {esc(origins)}</span>")
        rows = "".join(f"<tr title=\"{esc(render_witness(w))}\"><td><code>{esc(w.get('canary') or w.get('matched'))}</code></td><td>{esc(w.get('match'))}</td>"
                       f"<td>{esc(w.get('owner_rid') or 'unknown origin')}</td><td>{esc(w.get('owner_tenant'))}</td>"
                       f"<td>{esc(w.get('origin'))}</td><td>{esc(w.get('offsets'))}</td></tr>" for w in ws)
        if scn.run is not None and rid in scn.run.received:
            text = scn.response_text(rid)
            marks = [(w["offsets"][0], w["offsets"][1], _owner(w), w.get("matched")) for w in ws if w.get("offsets")]
            own_cs = r.canaries if r is not None else []
            body = highlight(text, marks, [canary.payload(c) for c in own_cs])
            own = " ".join(f"<code>{esc(c)}</code>" for c in own_cs) or "none"
            reply = (f'<div>reply as the checker scanned it (every view of what the client received: text, error, '
                     f'raw bytes, the stream re-read, metadata; leaked text highlighted, '
                     f'own canaries green; own: {own}):</div><pre class="reply">{body}</pre>')
        else:
            # no reply record for the victim: mark the leaked text inside the oracle's excerpt
            marks = [(-1, -1, _owner(w), w.get("matched")) for w in ws]
            reply = f'<div>excerpt:</div><pre class="reply">{highlight(w0.get("excerpt") or "", marks, [])}</pre>'
        parts.append(f'<div class="witness {cls}" data-victim="{esc(rid)}"'
                     + (f' data-scenario="{sid}"' if sid is not None else "") + f"><div>{head}</div>{reply}"
                     f"<table><tr><th>canary</th><th>match</th><th>owner rid</th><th>owner tenant</th>"
                     f"<th>origin</th><th>offsets</th></tr>{rows}</table></div>")
    return "".join(parts)


def _witness_table(ws: list, limit: int = MAX_WITNESSES, where: str = "verdicts.json") -> str:
    if not ws:
        return ""
    rows_in = [w if isinstance(w, dict) else {"value": w} for w in ws[:limit]]
    keys = _columns(rows_in)
    head = "".join(f"<th>{esc(k)}</th>" for k in keys)
    rows = "".join("<tr>" + "".join(f"<td>{esc(_short(w.get(k)))}</td>" for k in keys) + "</tr>" for w in rows_in)
    more = f'<p class="muted">… {len(ws) - limit} more in {esc(where)}</p>' if len(ws) > limit else ""
    return f"<table><tr>{head}</tr>{rows}</table>{more}"


def _other_witnesses(v, where: str = "verdicts.json") -> str:
    ws = v.get("witnesses") or []
    if not ws:
        return ""
    lines = "".join(f"<li>{esc(render_witness(w))}</li>" for w in ws[:MAX_WITNESSES])
    return (f'<div class="witness other" data-oracle="{esc(v.get("oracle"))}"><div><b>{esc(v.get("oracle"))}</b> '
            f"witnesses ({len(ws)})</div><ul class=\"lines\">{lines}</ul>{_witness_table(ws, where=where)}</div>")


def _columns(rows) -> list:
    """Every key of the dict rows, in first-seen order: a table's header."""
    return list(dict.fromkeys(k for r in rows for k in r))


def _short(x, n: int = 240) -> str:
    s = x if isinstance(x, str) else json.dumps(x, default=str)
    return s if len(s) <= n else s[:n] + "…"


def _scn_ref(i, scn) -> str:
    test = f" · test <code>{esc(scn.test)}</code>" + (f" {badge(scn.test_outcome)}" if scn.test_outcome else "") \
        if scn.test else ""
    eng = f" · {esc(scn.engine)} {esc(scn.version)}" if scn.engine or scn.version else ""
    return f'experiment <a href="#scenario-{i}"><b>{esc(scn.name)}</b></a>{test}{eng}'


# --------------------------------------------------------------------------- leading sections
def _leaks_section(m) -> str:
    items = run_leaks(m)
    n_real = sum(1 for s in m.scenarios if not s.planted)
    if not items:
        if not n_real:
            return ""
        return ('<section id="leaks" data-count="0"><h2>Leaks</h2><p>No leak: no FAIL of a leak checker '
                f"(isolation, integrity, page_ownership, kv_lifecycle, ...) in {n_real} experiment(s) that were not "
                "planted.</p></section>")
    out = [f'<section id="leaks" data-count="{len(items)}"><h2>Leaks ({len(items)} witness(es), '
           f"{len({(x['scenario'], x['witness'].get('victim_rid') or x['witness'].get('rid')) for x in items})} "
           "request(s))</h2>"]
    groups: dict = {}
    for x in items:
        groups.setdefault((x["scenario"], x["oracle"]), []).append(x)
    for (i, oracle), xs in groups.items():
        scn = m.scenarios[i]
        v = next(v for v in scn.verdicts if v.get("oracle") == oracle and v.get("status") == "fail")
        out.append(f'<div class="leak-group" data-scenario="{i}" data-oracle="{esc(oracle)}">'
                   f"<h3>{badge('fail')} {esc(oracle)} in {_scn_ref(i, scn)} — {_verdict_outcome(v)}</h3>"
                   f'<div class="muted">{esc(v.get("summary"))}</div>')
        if oracle == "isolation":
            out.append(_isolation_witnesses(scn, v, "leak", i))
        else:
            out.append(_other_witnesses(v, scn.source))
        out.append("</div>")
    out.append("</section>")
    return "".join(out)


def _links(urls) -> str:
    return ", ".join(f'<a href="{esc(u)}" rel="noreferrer">{esc(u)}</a>' for u in urls or []) or "none listed"


def _known_section(m) -> str:
    ks = known_findings(m)
    if not ks:
        return ""
    out = [f'<section id="known" data-count="{len(ks)}"><h2>Known findings ({len(ks)})</h2>'
           '<p class="muted">A departure from what was required that matches a listed engine finding (kvchaos/findings.toml) '
           "for this engine version, witness by witness: accepted, it is its own outcome (never PASS); not accepted, "
           "it is red.</p>"]
    for k in ks:
        i = k.get("scenario")
        where = (_scn_ref(i, m.scenarios[i]) if i is not None else
                 f"experiment <b>{esc(k.get('experiment'))}</b> · test <code>{esc(k.get('test'))}</code>")
        acc = badge("known", "accepted") if k.get("accepted") else badge("fail", "NOT accepted — red")
        ws = k.get("witnesses") or []
        out.append(f'<div class="known-finding" data-finding="{esc(k.get("id"))}" data-accepted="{int(bool(k.get("accepted")))}">'
                   f"<h3>{badge('known', 'KNOWN')} <code>{esc(k.get('id'))}</code> — {esc(k.get('title'))} {acc}</h3>"
                   f"<div>{esc(k.get('engine'))} {esc(k.get('version'))} · {where}</div>"
                   f"<div>{esc(k.get('oracle'))} {badge(k.get('status'))} {esc(k.get('summary'))}</div>"
                   f"<div>upstream: {_links(k.get('upstream'))}</div>"
                   + (f"<div>measured under: {esc(k.get('conditions'))}</div>" if k.get("conditions") else "")
                   + f"<div><b>witnesses ({len(ws)})</b></div>{_witness_table(ws, 10)}</div>")
    out.append("</section>")
    return "".join(out)


def _not_reproduced_section(m) -> str:
    nr = (m.findings or {}).get("not_reproduced") or []
    if not nr:
        return ""
    strict = (m.findings or {}).get("strict")
    rows = "".join(f'<li data-finding="{esc(n.get("id"))}">{esc(n.get("message"))}</li>' for n in nr)
    return (f'<section id="not-reproduced"><h2>Did not reproduce ({len(nr)})</h2>'
            f"<p>{'--kvchaos-strict: each one fails the run.' if strict else 'Listed findings a test exercising them did not show on this engine version — fixed? (a failure under --kvchaos-strict)'}</p>"
            f"<ul>{rows}</ul></section>")


# --------------------------------------------------------------------------- scenarios
def scenario_html(i: int, scn) -> str:
    vrows = "".join(f"<tr><td>{esc(v.get('oracle'))}</td><td>{badge(v.get('status'))}</td>"
                    f"<td>{esc(str(v['required']).upper()) if v.get('required') else ''}</td>"
                    f"<td>{_verdict_outcome(v) if v.get('outcome') else ''}</td><td>{esc(v.get('summary'))}</td>"
                    f"<td>{len(v.get('witnesses') or [])}</td></tr>" for v in scn.verdicts)
    if scn.planted:
        head_badge = (badge("pass", "PLANTED — CAUGHT") if scn.caught else badge("fail", "PLANTED — MISSED"))
        label = (f'<div class="planted-label">planted — {"caught as required" if scn.caught else "MISSED"}</div>'
                 f'<div class="muted">planted on purpose: {esc(scn.planted)} — '
                 + ("its FAIL verdicts were required: they prove the harness sees this bug, and say nothing "
                    "about the engine" if scn.caught else
                    "a required verdict did not come out: the harness did not show it sees this bug") + "</div>")
    else:
        head_badge, label = badge(scn.run_status), ""
    meta = [esc(scn.source)]
    if scn.events_file:
        meta.append(f"events {esc(scn.events_file)}")
    if scn.id:
        meta.append(f"id <code>{esc(scn.id)}</code>")
    meta += [f"{len(scn.requests)} requests", f"{len(scn.faults)} fault window(s)"]
    if scn.test:
        meta.append(f"test <code>{esc(scn.test)}</code>" + (f" {badge(scn.test_outcome)}" if scn.test_outcome else ""))
    if scn.engine or scn.version:
        meta.append(f"{esc(scn.engine)} {esc(scn.version)}")
    out = [f'<section class="scenario" id="scenario-{i}" data-status="{esc(scn.status)}" '
           f'data-run-status="{esc(scn.run_status)}" data-planted="{int(bool(scn.planted))}">',
           f"<h2>{head_badge} {esc(scn.name)}</h2>", label,
           f'<div class="muted">{" · ".join(meta)}</div>',
           (f'<div class="context"><b>{esc(scn.context)}</b></div>' if scn.context and not scn.planted else ""),
           (f'<div class="note"><b>note:</b> {esc(scn.note)}</div>' if scn.note else ""),
           '<table class="verdicts"><tr><th>oracle</th><th>verdict</th><th>required</th><th>outcome</th>'
           f"<th>summary</th><th>witnesses</th></tr>{vrows}</table>"]
    if scn.summary:
        out.append(f"<details><summary>scenario summary</summary><pre>{esc(json.dumps(scn.summary, indent=1, default=str))}</pre></details>")
    if scn.faults and scn.t0 is not None:
        frows = "".join(f"<tr><td>{esc(w.fault)}</td><td>{esc(w.kind)}</td><td>{esc(w.role)}</td>"
                        f"<td>{w.start - scn.t0:+.2f}</td><td>{'' if w.end is None else f'{w.end - scn.t0:+.2f}'}</td>"
                        f"<td>{len(w.fired)}</td></tr>" for w in scn.faults)
        out.append('<table class="faults"><tr><th>fault</th><th>kind</th><th>role</th><th>armed (s)</th>'
                   f"<th>healed (s)</th><th>fired</th></tr>{frows}</table>")
    if any(r.send is not None for r in scn.requests.values()):
        out.append(f'<figure class="timeline">{plots.timeline(scn)}</figure>')
        out.append(f'<figure class="latency">{plots.latency(scn)}</figure>')
    for v in scn.verdicts:
        leak = leak_verdict(v)
        if leak and not scn.planted:
            n = len(v.get("witnesses") or [])
            out.append(f'<p><a href="#leaks">{esc(v.get("oracle"))}: {n} leak witness(es) — listed under Leaks</a></p>')
        elif leak and v.get("oracle") == "isolation":
            n = len({w.get("victim_rid") for w in v.get("witnesses") or [] if isinstance(w, dict)})
            out.append(f"<details><summary>planted leaks seen ({n} victim(s), as required)</summary>"
                       + _isolation_witnesses(scn, v, "planted-leak") + "</details>")
        else:
            out.append(_other_witnesses(v, scn.source))
    out.append("</section>")
    return "\n".join(out)


# --------------------------------------------------------------------------- the rest
def _matrix(m) -> str:
    dm = m.extras.get("detection_matrix.json")
    if not dm:
        return ""
    rows = dm.get("rows") if isinstance(dm, dict) else None
    rows = rows if isinstance(rows, list) else dm if isinstance(dm, list) else [dm]
    keys = _columns(r for r in rows if isinstance(r, dict))
    head = "".join(f"<th>{esc(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{esc(_short(r.get(k)))}</td>" for k in keys) + "</tr>"
                   for r in rows if isinstance(r, dict))
    return f'<h2>Detection matrix</h2><table id="matrix"><tr>{head}</tr>{body}</table>'


def _engine_errors(m) -> str:
    errs = m.extras.get("engine_errors") or []
    if not errs:
        return ""
    parts = "".join(f'<div class="witness other engine-error"><div><b>{esc(e.get("role"))}</b> '
                    f'{esc(e.get("signature"))} during <code>{esc(e.get("test"))}</code>; restarted: '
                    f'{esc(_short(e.get("healed")))}</div><pre>{esc(e.get("traceback"))}</pre></div>' for e in errs)
    return f'<h2>Engine failures (process alive, no longer working; the role was restarted)</h2>{parts}'


def _audits(m) -> str:
    out = []
    for path, res in (m.extras.get("audits") or {}).items():
        rows = "".join(f"<tr><td>{esc(c.get('id'))}</td><td>{esc(c.get('role'))}</td><td>{badge(c.get('status'))}</td>"
                       f"<td><code>{esc(_short(c.get('numbers'), 300))}</code></td><td>{esc(c.get('detail'))}</td></tr>"
                       for c in res.get("checks", []))
        tg = res.get("targets") or {}
        out.append(f'<h2>Deployment audit <span class="muted">({esc(path)}: prefill {esc(tg.get("prefill"))}, '
                   f'decode {esc(tg.get("decode"))})</span></h2><table class="audit"><tr><th>check</th><th>role</th>'
                   f"<th>status</th><th>numbers</th><th>detail</th></tr>{rows}</table>")
    return "".join(out)


def counts_line(counts: dict) -> str:
    """"N passed, N failed" always, then every other outcome that occurred."""
    first = [f"{counts.get('passed', 0)} passed", f"{counts.get('failed', 0)} failed"]
    rest = [f"{n} {k}" for k, n in sorted(counts.items()) if k not in ("passed", "failed") and n]
    return ", ".join(first + rest)


def _tests(m) -> str:
    by_test: dict = {}
    for i, s in enumerate(m.scenarios):
        if s.test:
            by_test.setdefault(s.test, []).append(f'<a href="#scenario-{i}">{esc(s.name)}</a>')
    chaos = m.chaos_tests
    out = []
    if chaos:
        trows = "".join(f'<tr data-outcome="{esc(t.outcome)}"><td>{badge(t.outcome)}</td><td><code>{esc(t.nodeid)}</code></td>'
                        f"<td>{', '.join(by_test.get(t.nodeid, []))}</td><td>{t.time_s:.1f}</td>"
                        f"<td>{esc(_short(t.message, 400))}</td></tr>" for t in chaos)
        out.append('<h2>Tests that ran an experiment</h2><table id="tests"><tr><th>outcome</th><th>test</th>'
                   f"<th>experiments</th><th>s</th><th>message</th></tr>{trows}</table>")
    harness = m.harness_tests
    if harness:
        counts: dict = {}
        for t in harness:
            counts[t.outcome] = counts.get(t.outcome, 0) + 1
        bad = [t for t in harness if t.outcome in FAILED_TESTS]
        fails = "".join(f"<li>{badge(t.outcome)} <code>{esc(t.nodeid)}</code> "
                        f"<span class=\"muted\">{esc(_short(t.message, 300))}</span></li>" for t in bad)
        out.append(f'<div id="harness-tests" data-failed="{len(bad)}"><b>harness tests:</b> {esc(counts_line(counts))} '
                   '<span class="muted">(the harness\'s own tests: not part of the chaos verdict)</span>'
                   + (f'<ul id="harness-failures">{fails}</ul>' if bad else "") + "</div>")
    return "".join(out)


def render(m, verdicts: dict) -> str:
    counts = verdicts["tests"]["counts"]
    overall, chaos = verdicts["overall"], verdicts.get("chaos", verdicts["overall"])
    cl = m.cluster or {}
    spec = cl.get("spec") or {}
    cl_line = ", ".join(f"{k}={spec[k]}" for k in ("engine", "model", "device", "transfer_backend", "pool_tokens",
                                                      "context_length", "router") if k in spec)
    logs = "".join(f"<details><summary><a href=\"{esc(p)}\">{esc(p)}</a> ({size} bytes)</summary><pre>{esc(tail)}</pre></details>"
                   for p, size, tail in m.logs)
    n_real = sum(1 for s in m.scenarios if not s.planted)
    n_planted = len(m.scenarios) - n_real
    chaos_note = (f' <span class="muted">(chaos verdict: {esc(LABEL.get(chaos, chaos))})</span>'
                  if chaos != overall else "")
    seed = ((m.extras or {}).get("run.json") or {}).get("seed")
    seed_note = (f' · seed <code id="seed">{esc(seed)}</code> (replay: <code>kvchaos replay {esc(m.run_dir)}</code>)'
                 if seed is not None else "")
    summary = (f'<div id="summary" data-overall="{esc(overall)}" data-chaos="{esc(chaos)}">'
               f'<h1>kvchaos report <span id="verdict">{badge(overall, LABEL.get(overall), big=True)}</span>{chaos_note}</h1>'
               f'<div id="reason">{esc(verdicts.get("reason"))}</div>'
               f'<div>run <code>{esc(m.run_id)}</code>{seed_note} · generated {esc(time.strftime("%Y-%m-%d %H:%M:%S"))} · '
               f"{n_real} experiment(s)" + (f" + {n_planted} planted" if n_planted else "")
               + f' · <span id="test-counts">tests: '
               + (esc(counts_line(counts)) if m.tests else "no JUnit / progress file") + "</span></div>"
               + (f'<div class="muted">cluster: {esc(cl_line)}</div>' if cl_line else "")
               + ("<div class=\"muted\">oracles (experiments not planted): " + ", ".join(
                   f"{esc(o)} {c.get('fail', 0)}✗ {c.get('unknown', 0)}? {c.get('pass', 0)}✓"
                   for o, c in sorted(verdicts["by_oracle"].items())) + "</div>" if verdicts["by_oracle"] else "")
               + "</div>")
    body = [summary, _leaks_section(m), _known_section(m), _not_reproduced_section(m),
            _engine_errors(m), _matrix(m), _audits(m)]
    if m.scenarios:
        body.append(f"<h2>Experiments ({len(m.scenarios)})</h2>")
    body += [scenario_html(i, s) for i, s in enumerate(m.scenarios)]
    body.append(_tests(m))
    body.append(f'<section id="logs"><h2>Engine logs</h2>{logs or "<p class=muted>none in this run directory</p>"}</section>')
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>kvchaos {esc(m.run_id)}: {esc(LABEL.get(overall, overall))}</title><style>{CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>")

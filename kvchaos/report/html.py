"""The self-contained ``report.html``: no external file, script or font; plots are inline SVG.

Elements a reader (and ``tests/test_report_html.py``) finds:
``#summary`` (run, overall verdict, test counts), ``table#tests``, one ``section.scenario`` per
scenario with ``table.verdicts``, ``figure.timeline svg``, ``figure.latency svg`` and
``div.witness`` blocks (isolation witnesses show the victim's reply with the leaked text in
``mark.leak`` and its own canaries in ``mark.own``), ``table#matrix`` when the run has a
detection matrix, ``section#logs`` with the tail of every engine log.
"""

from __future__ import annotations

import html
import json
import time

from kvchaos import canary

from . import plots

CSS = """
body{font:13px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1180px;color:#222}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 6px;border-bottom:1px solid #ddd;padding-bottom:3px}
h3{font-size:13px;margin:14px 0 4px}
table{border-collapse:collapse;margin:6px 0;width:100%} td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f4} code,pre{font:12px/1.35 ui-monospace,SFMono-Regular,Menlo,monospace}
pre{background:#f7f7f7;padding:6px;overflow-x:auto;white-space:pre-wrap;word-break:break-all;margin:4px 0}
.badge{display:inline-block;padding:1px 7px;border-radius:9px;font-weight:600;font-size:11px;color:#fff}
.pass,.passed{background:#2e7d32}.fail,.failed,.error{background:#c62828}.unknown{background:#8d6e00}
.xfailed,.skipped{background:#6d6d6d}
mark.leak{background:#ffcdd2;color:#b71c1c;font-weight:700;outline:1px solid #c62828}
mark.own{background:#c8e6c9;color:#1b5e20}
.witness{border-left:4px solid #c62828;padding:4px 10px;margin:8px 0;background:#fffafa}
.witness.other{border-left-color:#8d6e00;background:#fffdf5}
figure{margin:8px 0} figure svg{max-width:100%;height:auto}
.muted{color:#666} details{margin:4px 0} summary{cursor:pointer}
"""

MAX_WITNESSES = 40


def esc(x) -> str:
    return html.escape("" if x is None else str(x))


def badge(status) -> str:
    s = esc(status or "unknown")
    return f'<span class="badge {s}">{s.upper()}</span>'


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


def _response_text(r) -> str:
    # the isolation oracle's offsets index this exact string (oracles.Run.response_text)
    return (r.text or "") + ("\n" + r.error if r.error else "")


def _isolation_witnesses(scn, v) -> str:
    by_victim: dict = {}
    for w in v.get("witnesses") or []:
        by_victim.setdefault(w.get("victim_rid"), []).append(w)
    parts = []
    for n, (rid, ws) in enumerate(by_victim.items()):
        if n >= MAX_WITNESSES:
            parts.append(f'<p class="muted">… {len(by_victim) - n} more victims in verdicts.json</p>')
            break
        r = scn.requests.get(rid)
        w0 = ws[0]
        owners = ", ".join(sorted({f"{w.get('owner_rid')} ({w.get('owner_tenant')})" for w in ws}))
        head = (f"<b>{esc(rid)}</b> (tenant <b>{esc(w0.get('victim_tenant'))}</b>, HTTP {esc(w0.get('status'))}) "
                f"received {len(ws)} canar{'y' if len(ws) == 1 else 'ies'} of {esc(owners)}")
        rows = "".join(f"<tr><td><code>{esc(w.get('canary'))}</code></td><td>{esc(w.get('match'))}</td>"
                       f"<td>{esc(w.get('owner_rid'))}</td><td>{esc(w.get('owner_tenant'))}</td>"
                       f"<td>{esc(w.get('offsets'))}</td></tr>" for w in ws)
        if r is not None:
            text = _response_text(r)
            leaks = [(w["offsets"][0], w["offsets"][1], f"{w.get('owner_rid')} ({w.get('owner_tenant')})",
                      w.get("matched")) for w in ws if w.get("offsets")]
            body = highlight(text, leaks, [canary.payload(c) for c in r.canaries])
            own = " ".join(f"<code>{esc(c)}</code>" for c in r.canaries) or "none"
            reply = (f'<div>reply (leaked text highlighted, own canaries green; own: {own}):</div>'
                     f'<pre class="reply">{body}</pre>')
        else:
            # no request record for the victim: mark the leaked text inside the oracle's excerpt
            marks = [(-1, -1, f"{w.get('owner_rid')} ({w.get('owner_tenant')})", w.get("matched")) for w in ws]
            reply = f'<div>excerpt:</div><pre class="reply">{highlight(w0.get("excerpt") or "", marks, [])}</pre>'
        parts.append(f'<div class="witness leak" data-victim="{esc(rid)}"><div>{head}</div>{reply}'
                     f"<table><tr><th>canary</th><th>match</th><th>owner rid</th><th>owner tenant</th>"
                     f"<th>offsets</th></tr>{rows}</table></div>")
    return "".join(parts)


def _other_witnesses(v) -> str:
    ws = v.get("witnesses") or []
    if not ws:
        return ""
    keys = _columns(w if isinstance(w, dict) else {"value": w} for w in ws[:MAX_WITNESSES])
    head = "".join(f"<th>{esc(k)}</th>" for k in keys)
    rows = "".join("<tr>" + "".join(f"<td>{esc(_short(w.get(k) if isinstance(w, dict) else w))}</td>" for k in keys)
                   + "</tr>" for w in ws[:MAX_WITNESSES])
    more = f'<p class="muted">… {len(ws) - MAX_WITNESSES} more in verdicts.json</p>' if len(ws) > MAX_WITNESSES else ""
    return (f'<div class="witness other" data-oracle="{esc(v.get("oracle"))}"><div><b>{esc(v.get("oracle"))}</b> '
            f"witnesses ({len(ws)})</div><table><tr>{head}</tr>{rows}</table>{more}</div>")


def _columns(rows) -> list:
    """Every key of the dict rows, in first-seen order: a table's header."""
    return list(dict.fromkeys(k for r in rows for k in r))


def _short(x, n: int = 240) -> str:
    s = x if isinstance(x, str) else json.dumps(x, default=str)
    return s if len(s) <= n else s[:n] + "…"


def scenario_html(i: int, scn) -> str:
    vrows = "".join(f"<tr><td>{esc(v.get('oracle'))}</td><td>{badge(v.get('status'))}</td><td>{esc(v.get('summary'))}</td>"
                    f"<td>{len(v.get('witnesses') or [])}</td></tr>" for v in scn.verdicts)
    out = [f'<section class="scenario" id="scenario-{i}" data-status="{esc(scn.status)}">',
           f"<h2>{badge(scn.status)} {esc(scn.name)}</h2>",
           f'<div class="muted">{esc(scn.source)} · {len(scn.requests)} requests · {len(scn.faults)} fault window(s)'
           + (f" · test <code>{esc(scn.test)}</code> {badge(scn.test_outcome)}" if scn.test else "") + "</div>",
           (f'<div class="context"><b>{esc(scn.context)}</b></div>' if scn.context else ""),
           f'<table class="verdicts"><tr><th>oracle</th><th>verdict</th><th>summary</th><th>witnesses</th></tr>{vrows}</table>']
    if scn.summary:
        out.append(f"<details><summary>scenario summary</summary><pre>{esc(json.dumps(scn.summary, indent=1, default=str))}</pre></details>")
    if scn.faults:
        frows = "".join(f"<tr><td>{esc(w.fault)}</td><td>{esc(w.kind)}</td><td>{esc(w.role)}</td>"
                        f"<td>{w.start - scn.t0:+.2f}</td><td>{'' if w.end is None else f'{w.end - scn.t0:+.2f}'}</td>"
                        f"<td>{len(w.fired)}</td></tr>" for w in scn.faults)
        out.append('<table class="faults"><tr><th>fault</th><th>kind</th><th>role</th><th>armed (s)</th>'
                   f"<th>healed (s)</th><th>fired</th></tr>{frows}</table>")
    if any(r.send is not None for r in scn.requests.values()):
        out.append(f'<figure class="timeline">{plots.timeline(scn)}</figure>')
        out.append(f'<figure class="latency">{plots.latency(scn)}</figure>')
    for v in scn.verdicts:
        if v.get("oracle") == "isolation" and v.get("status") == "fail":
            out.append("<h3>Leaks</h3>" + _isolation_witnesses(scn, v))
        else:
            out.append(_other_witnesses(v))
    out.append("</section>")
    return "\n".join(out)


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


def render(m, verdicts: dict) -> str:
    counts = verdicts["tests"]["counts"]
    overall = verdicts["overall"]
    cl = m.cluster or {}
    spec = cl.get("spec") or {}
    cl_line = ", ".join(f"{k}={spec[k]}" for k in ("engine", "model", "device", "transfer_backend", "pool_tokens",
                                                      "context_length", "router") if k in spec)
    trows = "".join(f'<tr class="{esc(t.outcome)}"><td>{badge(t.outcome)}</td><td><code>{esc(t.nodeid)}</code></td>'
                    f"<td>{t.time_s:.1f}</td><td>{esc(_short(t.message, 400))}</td></tr>" for t in m.tests)
    tests = (f'<h2>Tests</h2><table id="tests"><tr><th>outcome</th><th>test</th><th>s</th><th>message</th></tr>{trows}</table>'
             if m.tests else "")
    logs = "".join(f"<details><summary><a href=\"{esc(p)}\">{esc(p)}</a> ({size} bytes)</summary><pre>{esc(tail)}</pre></details>"
                   for p, size, tail in m.logs)
    summary = (f'<div id="summary" data-overall="{overall}"><h1>kvchaos report {badge(overall)}</h1>'
               f'<div>run <code>{esc(m.run_id)}</code> · generated {esc(time.strftime("%Y-%m-%d %H:%M:%S"))} · '
               f"{len(m.scenarios)} scenario(s) · tests: "
               + (", ".join(f"{v} {esc(k)}" for k, v in sorted(counts.items())) or "no JUnit file")
               + "</div>" + (f'<div class="muted">cluster: {esc(cl_line)}</div>' if cl_line else "")
               + "<div class=\"muted\">oracles: " + ", ".join(
                   f"{esc(o)} {c.get('fail', 0)}✗ {c.get('unknown', 0)}? {c.get('pass', 0)}✓"
                   for o, c in sorted(verdicts["by_oracle"].items())) + "</div></div>")
    body = [summary, tests, _engine_errors(m), _matrix(m), _audits(m)] + [scenario_html(i, s) for i, s in enumerate(m.scenarios)]
    body.append(f'<section id="logs"><h2>Engine logs</h2>{logs or "<p class=muted>none in this run directory</p>"}</section>')
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>kvchaos {esc(m.run_id)}: {overall}</title><style>{CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>")

"""Timeline and latency plots of one scenario, as inline SVG written directly (text kept as text).

Timeline: one bar per request (send → end), grouped and coloured by tenant; faults as shaded windows
with their firing moments as ticks; leak victims marked with a red ✕ at the end of their bar and the
owner tenant named; requests a liveness witness names (hung, timed out) drawn red-edged with a ▼.
Latency: each request's latency against its send time, by outcome, leak victims circled.

Written as SVG elements rather than through a plotting library: a cluster session's report has
dozens of scenarios, and matplotlib took about 0.9 s a scenario, most of a CI session's report
(``python bench/report_build.py RUN_DIR --against 6c862db`` prints both; bench/RESULTS.md). Every
request's bar is a ``<g id="req-<rid>">``, every fault window a ``<g id="fault-<id>">``, so a reader
(or a test) can find them.
"""

from __future__ import annotations

import itertools
import math
from html import escape

MAX_ROWS = 1500
OUTCOME_STYLE = {  # edge colour, hatch
    "ok": (None, None), "http_error": ("#444444", None), "timeout": ("#d62728", "////"),
    "aborted": ("#7f7f7f", ".."), "disconnected": ("#7f7f7f", "xx"), "error": ("#d62728", "xx"),
}
OUTCOME_COLOR = {"ok": "#2ca02c", "http_error": "#ff7f0e", "timeout": "#d62728", "aborted": "#7f7f7f",
                 "disconnected": "#9467bd", "error": "#8c564b", None: "#bcbd22"}
TAB20 = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd",
         "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d",
         "#17becf", "#9edae5"]
FONT = 'font-family="DejaVu Sans, Arial, sans-serif"'
_ids = itertools.count(1)  # pattern ids unique within a page that inlines many figures


def _span(w, scn) -> tuple[float, float]:
    """A fault window in seconds since the scenario start; unhealed windows run to its end."""
    a = max(w.start, scn.t0) - scn.t0
    b = (w.end if w.end is not None else scn.t1) - scn.t0
    return a, max(b, a + 0.05)


def marks(scn) -> tuple[dict, set]:
    """rid -> owner tenants of the canaries it leaked; rids a liveness witness names."""
    leaks, hung = {}, set()
    for v in scn.verdicts:
        for w in v.get("witnesses") or []:
            if not isinstance(w, dict):
                continue
            if v.get("oracle") == "isolation" and w.get("victim_rid"):
                leaks.setdefault(w["victim_rid"], set()).add(w.get("owner_tenant"))
            elif v.get("oracle") == "liveness" and w.get("rid"):
                hung.add(w["rid"])
    return leaks, hung


def ticks(hi: float, n: int = 8) -> list[float]:
    """Round tick values from 0 to ``hi`` (at most about ``n``)."""
    if not hi > 0 or not math.isfinite(hi):
        return [0.0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [round(i * step, 10) for i in range(int(hi / step + 1e-9) + 1)]


def _num(x: float) -> str:
    return f"{x:g}" if abs(x) < 1e5 else f"{x:.3g}"


def _text(x, y, s, size=8, anchor="start", color="#222", weight=None, baseline=None, rotate=None) -> str:
    extra = (f' font-weight="{weight}"' if weight else "") + (f' dominant-baseline="{baseline}"' if baseline else "")
    extra += f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate is not None else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{color}" {FONT}'
            f'{extra}>{escape(str(s))}</text>')


def _hatch_defs(pid: str) -> tuple[str, dict]:
    """Pattern definitions for the outcome hatches; hatch -> fill url."""
    defs, urls = [], {}
    for i, (h, path) in enumerate((("////", "M0,6 L6,0"), ("..", "M2,2 h0.8 M5,5 h0.8"), ("xx", "M0,0 L6,6 M0,6 L6,0"))):
        p = f"{pid}-h{i}"
        defs.append(f'<pattern id="{p}" width="6" height="6" patternUnits="userSpaceOnUse">'
                    f'<path d="{path}" stroke="#333" stroke-width="0.8" fill="none"/></pattern>')
        urls[h] = f"url(#{p})"
    return "<defs>" + "".join(defs) + "</defs>", urls


class _Axes:
    """A plot area: data (x from 0, y) to pixels."""

    def __init__(self, left, top, width, height, xmax, ymin, ymax, flip=False):
        self.l, self.t, self.w, self.h = left, top, width, height
        self.xmax, self.ymin, self.ymax, self.flip = xmax, ymin, ymax, flip

    def x(self, v):
        return self.l + self.w * min(max(v, 0.0), self.xmax) / self.xmax

    def y(self, v):
        f = (v - self.ymin) / ((self.ymax - self.ymin) or 1.0)
        return self.t + (f * self.h if self.flip else (1 - f) * self.h)

    def frame(self, xlabel, xticks, yticks=(), ylabel=None, grid_y=False) -> list[str]:
        out = [f'<rect x="{self.l}" y="{self.t}" width="{self.w}" height="{self.h}" fill="none" stroke="#333" stroke-width="0.8"/>']
        for v in xticks:
            px = self.x(v)
            out.append(f'<line x1="{px:.1f}" y1="{self.t}" x2="{px:.1f}" y2="{self.t + self.h}" stroke="#000" stroke-opacity="0.12"/>')
            out.append(_text(px, self.t + self.h + 12, _num(v), anchor="middle"))
        for v, label in yticks:
            py = self.y(v)
            if grid_y:
                out.append(f'<line x1="{self.l}" y1="{py:.1f}" x2="{self.l + self.w}" y2="{py:.1f}" stroke="#000" stroke-opacity="0.12"/>')
            out.append(_text(self.l - 4, py, label, size=6 if not grid_y else 8, anchor="end", baseline="middle"))
        out.append(_text(self.l + self.w / 2, self.t + self.h + 26, xlabel, size=8, anchor="middle"))
        if ylabel:
            out.append(_text(self.l - 40, self.t + self.h / 2, ylabel, anchor="middle", rotate=-90))
        return out


def _legend(x, y, items) -> list[str]:
    """(kind, colour, label, hatch url) rows; kind "box" or "dot" or "ring"."""
    out = []
    for i, (kind, color, label, hatch) in enumerate(items):
        yy = y + 11 * i
        if kind == "box":
            out.append(f'<rect x="{x}" y="{yy - 7}" width="12" height="8" fill="{color}"'
                       + (' fill-opacity="0.3"' if label == "fault window" else "") + "/>")
            if hatch:
                out.append(f'<rect x="{x}" y="{yy - 7}" width="12" height="8" fill="{hatch}" stroke="#d62728" stroke-width="0.8"/>')
        elif kind == "dot":
            out.append(f'<circle cx="{x + 6}" cy="{yy - 3}" r="3" fill="{color}"/>')
        else:
            out.append(f'<circle cx="{x + 6}" cy="{yy - 3}" r="4.5" fill="none" stroke="{color}" stroke-width="1.5"/>')
        out.append(_text(x + 16, yy, label, size=6.5))
    return out


def _svg(width, height, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" '
            f'viewBox="0 0 {width} {height:.0f}" role="img">' + "".join(body) + "</svg>")


def timeline(scn) -> str:
    t0 = scn.t0
    reqs = sorted((r for r in scn.requests.values() if r.send is not None),
                  key=lambda r: (r.tenant or "", r.send))[:MAX_ROWS]
    leaks, hung = marks(scn)
    tenants = sorted({r.tenant or "?" for r in reqs})
    color = {t: TAB20[i % 20] for i, t in enumerate(tenants)}
    end_of_run = max([r.end or r.send for r in reqs] + [scn.t1 or t0]) - t0
    xmax = max(end_of_run, 0.1) * 1.04
    row = max(0.8, min(12.0, 1200.0 / max(len(reqs), 1)))
    left, top, width = 120, 34, 760
    height = max(row * max(len(reqs), 1), 110)
    ax = _Axes(left, top, width, height, xmax, -0.5, len(reqs) - 0.5, flip=True)
    pid = f"kvc{next(_ids)}"
    defs, hatch_url = _hatch_defs(pid)
    body = [defs, '<rect width="100%" height="100%" fill="white"/>',
            _text(left + width / 2, 14, f"{scn.name}: {len(reqs)} requests, {len(tenants)} tenants, "
                  f"{len(scn.faults)} fault(s)", size=9, anchor="middle")]
    for w in scn.faults:
        a, b = _span(w, scn)
        xa, xb = ax.x(a), ax.x(b)
        label = f" {w.kind}" + (f" ({w.role})" if w.role else "")
        g = [f'<rect x="{xa:.1f}" y="{top}" width="{max(xb - xa, 0.5):.1f}" height="{height:.1f}" fill="#ff9900" fill-opacity="0.13"/>',
             _text(xa, top - 3, label, size=7, color="#b35900")]
        g += [f'<line x1="{ax.x(f - t0):.1f}" y1="{top}" x2="{ax.x(f - t0):.1f}" y2="{top + 0.03 * height:.1f}" '
              f'stroke="#b35900" stroke-width="1.2"/>' for f in w.fired]
        body.append(f'<g id="fault-{escape(str(w.fault), quote=True)}">' + "".join(g) + "</g>")
    for y, r in enumerate(reqs):
        start = r.send - t0
        stop = (r.end if r.end is not None else scn.t1 or r.send) - t0
        edge, hatch = OUTCOME_STYLE.get(r.outcome, ("#d62728", "////"))
        if r.rid in hung:
            edge, hatch = "#d62728", hatch or "////"
        xa, xb = ax.x(start), ax.x(start + max(stop - start, 0.01))
        yc = ax.y(y)
        bw, bh = max(xb - xa, 0.6), row * 0.8
        stroke = f' stroke="{edge}" stroke-width="0.8"' if edge else ""
        g = [f'<rect x="{xa:.1f}" y="{yc - bh / 2:.2f}" width="{bw:.1f}" height="{bh:.2f}" fill="{color[r.tenant or "?"]}"{stroke}/>']
        if hatch:
            g.append(f'<rect x="{xa:.1f}" y="{yc - bh / 2:.2f}" width="{bw:.1f}" height="{bh:.2f}" fill="{hatch_url[hatch]}"/>')
        if r.first_byte is not None:
            fx = ax.x(r.first_byte - t0)
            g.append(f'<line x1="{fx:.1f}" y1="{yc - bh / 2:.2f}" x2="{fx:.1f}" y2="{yc + bh / 2:.2f}" stroke="black" stroke-width="0.5"/>')
        sx = ax.x(stop)
        if r.rid in leaks:
            g.append(_text(sx, yc, "✕", size=11, anchor="middle", color="#d62728", weight="bold", baseline="middle"))
            g.append(_text(sx + 7, yc, "LEAK ← " + ", ".join(sorted(o or "?" for o in leaks[r.rid])), size=7,
                           color="#d62728", weight="bold", baseline="middle"))
        if r.rid in hung:
            g.append(_text(sx, yc, "▼", size=8, anchor="middle", color="#d62728", baseline="middle"))
        body.append(f'<g id="req-{escape(r.rid, quote=True)}"><title>{escape(r.rid)} ({escape(str(r.tenant))}, '
                    f'{escape(str(r.outcome))})</title>' + "".join(g) + "</g>")
    if len(reqs) <= 80:
        yticks = [(y, r.rid) for y, r in enumerate(reqs)]
    else:
        firsts: dict = {}
        for y, r in enumerate(reqs):
            firsts.setdefault(r.tenant or "?", y)
        yticks = [(y, t) for t, y in firsts.items()]
    body += ax.frame("seconds since scenario start (bar: send → end; tick: first byte)", ticks(xmax), yticks)
    items = [("box", color[t], t, None) for t in tenants[:20]]
    items += [("box", "#ff9900", "fault window", None), ("box", "white", "timeout / hung", hatch_url["////"])]
    body += _legend(left + width + 12, top + 8, items)
    total_h = max(top + height + 36, top + 11 * len(items) + 16)
    return _svg(left + width + 130, total_h, body)


def latency(scn) -> str:
    t0 = scn.t0
    leaks, _hung = marks(scn)
    by: dict = {}
    for r in scn.requests.values():
        if r.send is None or r.latency_s is None:
            continue
        by.setdefault(r.outcome, []).append((r.send - t0, r.latency_s, r.rid))
    lk = [(r.send - t0, r.latency_s) for r in scn.requests.values()
          if r.rid in leaks and r.send is not None and r.latency_s is not None]
    pts = [p for v in by.values() for p in v]
    xmax = max([p[0] for p in pts] + [0.1]) * 1.05
    ymax = max([p[1] for p in pts] + [0.1]) * 1.1
    left, top, width, height = 120, 24, 760, 160
    ax = _Axes(left, top, width, height, xmax, 0.0, ymax)
    body = ['<rect width="100%" height="100%" fill="white"/>',
            _text(left + width / 2, 14, "request latency by outcome", size=9, anchor="middle")]
    for w in scn.faults:
        a, b = _span(w, scn)
        body.append(f'<rect x="{ax.x(a):.1f}" y="{top}" width="{max(ax.x(b) - ax.x(a), 0.5):.1f}" height="{height}" '
                    f'fill="#ff9900" fill-opacity="0.13"/>')
    items = []
    for outcome, ps in sorted(by.items(), key=lambda kv: str(kv[0])):
        c = OUTCOME_COLOR.get(outcome, "#17becf")
        body += [f'<circle cx="{ax.x(x):.1f}" cy="{ax.y(y):.1f}" r="2.4" fill="{c}" fill-opacity="0.85">'
                 f'<title>{escape(rid)}: {y:.2f} s</title></circle>' for x, y, rid in ps]
        items.append(("dot", c, f"{outcome} ({len(ps)})", None))
    if lk:
        body += [f'<circle cx="{ax.x(x):.1f}" cy="{ax.y(y):.1f}" r="5.5" fill="none" stroke="#d62728" stroke-width="1.5"/>'
                 for x, y in lk]
        items.append(("ring", "#d62728", f"leak victim ({len(lk)})", None))
    body += ax.frame("send time, s since scenario start", ticks(xmax),
                     [(v, _num(v)) for v in ticks(ymax, 4)], ylabel="latency, s", grid_y=True)
    body += _legend(left + width + 12, top + 8, items)
    return _svg(left + width + 130, max(top + height + 36, top + 11 * len(items) + 16), body)

"""Timeline and latency plots of one scenario, as inline SVG (matplotlib, Agg backend, text kept as text).

Timeline: one bar per request (send → end), grouped and coloured by tenant; faults as shaded windows
with their firing moments as ticks; leak victims marked with a red ✕ at the end of their bar and the
owner tenant named; requests a liveness witness names (hung, timed out) drawn red-edged with a ▼.
Latency: each request's latency against its send time, by outcome, leak victims circled.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

plt.rcParams.update({"svg.fonttype": "none", "font.size": 8, "axes.titlesize": 9})

MAX_ROWS = 1500
OUTCOME_STYLE = {  # edge colour, hatch
    "ok": (None, None), "http_error": ("#444444", None), "timeout": ("#d62728", "////"),
    "aborted": ("#7f7f7f", ".."), "disconnected": ("#7f7f7f", "xx"), "error": ("#d62728", "xx"),
}
OUTCOME_COLOR = {"ok": "#2ca02c", "http_error": "#ff7f0e", "timeout": "#d62728", "aborted": "#7f7f7f",
                 "disconnected": "#9467bd", "error": "#8c564b", None: "#bcbd22"}


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    s = buf.getvalue()
    return s[s.index("<svg"):]  # drop the XML prolog and DOCTYPE: the SVG goes inline into HTML


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


def timeline(scn) -> str:
    t0 = scn.t0
    reqs = sorted((r for r in scn.requests.values() if r.send is not None),
                  key=lambda r: (r.tenant or "", r.send))[:MAX_ROWS]
    leaks, hung = marks(scn)
    tenants = sorted({r.tenant or "?" for r in reqs})
    cmap = plt.get_cmap("tab20")
    color = {t: cmap(i % 20) for i, t in enumerate(tenants)}
    end_of_run = max([r.end or r.send for r in reqs] + [scn.t1 or t0]) - t0
    h = min(18.0, 1.2 + 0.11 * len(reqs))
    fig, ax = plt.subplots(figsize=(11, h))
    for w in scn.faults:
        a, b = _span(w, scn)
        ax.axvspan(a, b, color="#ff9900", alpha=0.13, lw=0, gid=f"fault-{w.fault}")
        ax.text(a, 1.0, f" {w.kind}" + (f" ({w.role})" if w.role else ""), transform=ax.get_xaxis_transform(),
                va="bottom", ha="left", fontsize=7, color="#b35900", clip_on=False)
        for f in w.fired:
            ax.axvline(f - t0, ymin=0.97, ymax=1.0, color="#b35900", lw=1.2)
    for y, r in enumerate(reqs):
        start = r.send - t0
        stop = (r.end if r.end is not None else scn.t1 or r.send) - t0
        edge, hatch = OUTCOME_STYLE.get(r.outcome, ("#d62728", "////"))
        if r.rid in hung:
            edge, hatch = "#d62728", hatch or "////"
        ax.broken_barh([(start, max(stop - start, 0.01))], (y - 0.4, 0.8), facecolors=color[r.tenant or "?"],
                       edgecolors=edge or "none", linewidth=0.8 if edge else 0, hatch=hatch, gid=f"req-{r.rid}")
        if r.first_byte is not None:
            ax.plot([r.first_byte - t0] * 2, [y - 0.4, y + 0.4], color="black", lw=0.5)
        if r.rid in leaks:
            ax.plot(stop, y, marker="X", color="#d62728", markersize=9, markeredgecolor="white", zorder=5)
            ax.annotate("LEAK ← " + ", ".join(sorted(o or "?" for o in leaks[r.rid])), (stop, y),
                        xytext=(6, -3), textcoords="offset points", color="#d62728", fontsize=7, weight="bold")
        if r.rid in hung:
            ax.plot(stop, y, marker="v", color="#d62728", markersize=7, zorder=5)
    if len(reqs) <= 80:
        ax.set_yticks(range(len(reqs)), [r.rid for r in reqs], fontsize=6)
    else:
        firsts = {}
        for y, r in enumerate(reqs):
            firsts.setdefault(r.tenant or "?", y)
        ax.set_yticks(list(firsts.values()), list(firsts.keys()), fontsize=6)
    ax.set_ylim(len(reqs) - 0.5, -0.5)
    ax.set_xlim(0, max(end_of_run, 0.1) * 1.04)
    ax.set_xlabel("seconds since scenario start (bar: send → end; tick: first byte)")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(facecolor=color[t], label=t) for t in tenants[:20]]
    handles += [Patch(facecolor="#ff9900", alpha=0.3, label="fault window"),
                Patch(facecolor="white", edgecolor="#d62728", hatch="////", label="timeout / hung")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=6, frameon=False)
    ax.set_title(f"{scn.name}: {len(reqs)} requests, {len(tenants)} tenants, {len(scn.faults)} fault(s)")
    return _svg(fig)


def latency(scn) -> str:
    t0 = scn.t0
    leaks, hung = marks(scn)
    fig, ax = plt.subplots(figsize=(11, 2.8))
    by: dict = {}
    for r in scn.requests.values():
        if r.send is None or r.latency_s is None:
            continue
        by.setdefault(r.outcome, []).append((r.send - t0, r.latency_s, r.rid))
    for outcome, pts in sorted(by.items(), key=lambda kv: str(kv[0])):
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, color=OUTCOME_COLOR.get(outcome, "#17becf"),
                   label=f"{outcome} ({len(pts)})", alpha=0.85)
    lk = [(r.send - t0, r.latency_s) for r in scn.requests.values()
          if r.rid in leaks and r.send is not None and r.latency_s is not None]
    if lk:
        ax.scatter([p[0] for p in lk], [p[1] for p in lk], s=90, facecolors="none", edgecolors="#d62728",
                   linewidths=1.5, label=f"leak victim ({len(lk)})")
    for w in scn.faults:
        ax.axvspan(*_span(w, scn), color="#ff9900", alpha=0.13, lw=0)
    ax.set_xlabel("send time, s since scenario start")
    ax.set_ylabel("latency, s")
    ax.grid(alpha=0.3)
    if by or lk:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    ax.set_title("request latency by outcome")
    return _svg(fig)

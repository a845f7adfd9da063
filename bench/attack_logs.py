"""Attack logs: event logs a judge must not misread, written by this file's own generators (the
project's writers: :class:`kvchaos.workload.events.EventLog` and the runner's closing record), each
judged by ``kvchaos judge`` of a checkout, its exit code held to what it must be — a leak or a blind run
never 0, a clean log 0, bad input 2.

    python bench/attack_logs.py                  # this checkout
    python bench/attack_logs.py --repo DIR       # another checkout's judge (e.g. a worktree of main)
    python bench/attack_logs.py --json F

Classes (issue "A judge no rewriting of the log can fool"): what the client received read partly
(reasoning_content, tool-call arguments, incremental /generate, logprob tokens, an error body, the
runner's own leak_seen), logs that are not whole (cut at a line boundary, two experiments in one file, a
newer schema), a false alarm (a drained release and a write end within two hosts' clock skew), and engine
versions PEP 440 reads (a local tag, a version that is not one). Prints one
line per log and the count judged wrong; exits 1 when any is."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvchaos import canary  # noqa: E402
from kvchaos.probe.contract import recital  # noqa: E402

N = 40  # requests per log: enough for isolation's power on the probe's echo


def _events(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _sse(field: str, pieces: list[str], rid: str) -> str:
    out = []
    for i, p in enumerate(pieces):
        if field == "reasoning":
            e = {"id": rid, "choices": [{"index": 0, "delta": {"reasoning_content": p}}]}
        elif field == "tool":
            e = {"id": rid, "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "function": {"name": "f", "arguments": p}}]}}]}
        elif field == "logprobs":
            e = {"id": rid, "choices": [{"index": 0, "delta": {}, "logprobs": {"content": [{"token": p, "logprob": -0.1}]}}]}
        elif field == "content":
            e = {"id": rid, "choices": [{"index": 0, "delta": {"content": p}}]}
        elif field == "incremental":
            e = {"text": p, "meta_info": {"id": rid, "completion_tokens": i + 1}}
        elif field == "error":
            e = {"error": {"message": p}}
        else:
            raise ValueError(field)
        out.append("data: " + json.dumps(e) + "\n\n")
    return "".join(out) + "data: [DONE]\n\n"


def _log(field="content", leak=False, header=True, version="0.5.23", schema=3, close=True, exp="e", seed=1,
         extra=(), n=N, endpoint="chat") -> list[dict]:
    """``n`` streamed replies, each its request's recital, one token per chunk in ``field`` (the reply's
    content also carries the recital unless the field is the content itself); with ``leak`` the last reply's
    ``field`` holds the first request's canary."""
    from kvchaos.history import CLOSE, digest

    rng = random.Random(seed)
    recs = [{"ev": "experiment", "schema": schema, "id": exp, "name": "attack", "n": n,
             "engine": {"name": "sglang", "version": version, "roles": {}}}] if header else []
    first = None
    for i in range(n):
        rid = f"{exp}{i}"
        cs = canary.mint(rng, 2)
        first = first or cs[0]
        want = recital(cs)
        carried = want[:-1] + first + "[" if leak and i == n - 1 else want
        if field in ("content", "incremental"):
            raw, text = _sse(field, list(carried), rid), carried
        else:  # the reply's content is clean; the other field carries the text, a token per chunk
            raw = _sse("content", list(want), rid) + _sse(field, list(carried), rid)
            text = want
        recs += [{"ev": "plan", "rid": rid, "tenant": f"t{i}", "canaries": cs, "expect_echo": True, "kind": "stream",
                  "endpoint": "generate" if field == "incremental" else endpoint, "stream": True},
                 {"ev": "send", "rid": rid, "wall": 1000.0 + i, "t": 10.0 + i},
                 {"ev": "status", "rid": rid, "status": 200},
                 {"ev": "body", "rid": rid, "text": text if field != "incremental" else carried[-1], "raw": raw,
                  "complete": True},
                 {"ev": "end", "rid": rid, "outcome": "ok", "latency_s": 0.2, "wall": 1000.2 + i, "t": 10.2 + i}]
    recs += list(extra)
    if header and close:
        recs.append({"ev": CLOSE, "id": exp, "records": len(recs), "digest": digest(recs), "counts": {}})
    return recs


def cases(d: Path) -> list[tuple[str, str, list[Path], list[str], str]]:
    """(class, name, files, judge flags, what the exit must be: "0", "not 0", "2")."""
    out = []
    add = lambda cls, name, recs, want, flags=(): out.append(  # noqa: E731
        (cls, name, [_events(d / f"{name}.jsonl", recs)], list(flags), want))
    # ---- what the client received, read partly
    add("received", "reasoning-content-token-per-chunk-leak", _log("reasoning", leak=True), "not 0")
    add("received", "tool-call-arguments-token-per-chunk-leak", _log("tool", leak=True), "not 0")
    add("received", "logprob-tokens-leak", _log("logprobs", leak=True), "not 0")
    add("received", "error-body-split-leak", _log("error", leak=True), "not 0")
    add("received", "incremental-generate-clean", _log("incremental", header=False), "0")
    add("received", "incremental-generate-leak", _log("incremental", leak=True, header=False), "not 0")
    add("received", "leak-seen-record-in-a-clean-log",
        _log(extra=[{"ev": "leak_seen", "oracle": "isolation", "victims": ["e3"], "owners": ["e0"], "after_s": 1.0}]),
        "not 0")
    add("received", "clean-streams-in-every-field", _log("reasoning"), "0")
    # ---- logs that are not whole
    whole = _log()
    add("whole", "clean-whole-log", whole, "0")
    cut = [r for r in whole if r["ev"] != "experiment_end"]
    add("whole", "clean-log-cut-at-a-line-boundary", cut[: len(cut) - 7], "not 0")
    add("whole", "clean-log-cut-before-its-close", cut, "not 0")
    blind = _log(exp="b", n=3, seed=2)  # three requests: no power to see a leak
    add("whole", "second-experiment-blind", whole + blind, "not 0")
    add("whole", "second-experiment-leaks-under-another-version",
        whole + _log(exp="v", leak=True, version="0.5.19", seed=3), "not 0", ["--accept-known"])
    add("whole", "newer-schema", _log(schema=99), "2")
    # ---- false alarms
    ag = {"ev": "agent", "source": "agent"}
    skew = [{**ag, "agent_ev": "kv_released", "role": "decode", "room": 7, "rid": "e3", "wall": 1003.0},
            {**ag, "agent_ev": "deferred_release", "role": "decode", "room": 7, "rid": "e3", "outcome": "drained",
             "wall": 1003.0},
            {**ag, "agent_ev": "write_end", "role": "prefill", "room": 7, "rid": "e3", "pages": 2, "wall_start": 1002.9,
             "wall": 1003.004}]  # 4 ms after decode's drained release, on the other host's clock
    add("false-alarm", "drained-release-4ms-before-write-end-across-hosts", _log(extra=skew), "0")
    # ---- versions
    add("versions", "local-version-tag-clean", _log(version="0.5.23+cu128"), "0")
    add("versions", "version-not-pep-440-leak", _log(version="nightly", leak=True), "not 0")
    add("versions", "version-not-pep-440-clean", _log(version="nightly"), "0")
    return out


def judge(repo: Path, files: list[Path], flags: list[str]) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "kvchaos", "judge", *flags, *map(str, files)], cwd=str(repo),
                       capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    return r.returncode, (r.stdout + r.stderr)


def ok(want: str, rc: int) -> bool:
    return {"0": rc == 0, "not 0": rc not in (0, 2) and rc in (1, 3), "2": rc == 2}[want]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose kvchaos judge judges (default: this)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvchaos-attack-") as tmp:
        for cls, name, files, flags, want in cases(Path(tmp)):
            rc, out = judge(a.repo, files, flags)
            good = ok(want, rc)
            tail = out.strip().splitlines()[-1][:150] if out.strip() else ""
            if rc not in (0, 1, 2, 3):
                tail = "TRACEBACK: " + (out.strip().splitlines() or [""])[-1][:150]
            rows.append({"class": cls, "log": name, "want": want, "exit": rc, "right": good, "last_line": tail})
            print(f"{'ok   ' if good else 'WRONG'} {cls:9} {name:50} want {want:6} exit {rc}  {tail}")
    wrong = [r for r in rows if not r["right"]]
    print(f"{len(rows)} attack logs, {len(wrong)} judged wrong ({a.repo})")
    if a.json:
        a.json.write_text(json.dumps({"repo": str(a.repo), "rows": rows}, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

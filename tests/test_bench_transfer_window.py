"""bench/transfer_window.py pairs the engines' own events of each request: its writes, decode's
pre-allocation, prefill's first transfer_start; bytes from the layout's probe geometry."""

import json
from pathlib import Path

import pytest

from tests.util import load_file

REPO = Path(__file__).resolve().parents[1]


def _bench():
    return load_file(REPO / "bench" / "transfer_window.py", "transfer_window_bench")


def _log(path, layout, rid="r1", pages=(2, 3), start=100.0, write_s=0.5):
    ev = [{"ev": "experiment", "schema": 2, "layout": {"kv_layout": layout, "spec": {}}},
          {"ev": "agent", "agent_ev": "kv_prealloc", "source": "agent", "role": "decode", "rid": rid, "wall": start - 1},
          {"ev": "agent", "agent_ev": "transfer_start", "source": "agent", "role": "prefill", "rid": rid, "wall": start}]
    t = start
    for n in pages:
        ev.append({"ev": "agent", "agent_ev": "write_end", "source": "agent", "role": "prefill", "rid": rid, "pages": n,
                   "page_size": 64, "wall_start": t, "wall": t + write_s})
        t += write_s
    path.write_text("\n".join(map(json.dumps, ev)) + "\n{cut")
    return path


def test_windows_and_bytes_come_from_the_events_and_the_layouts_geometry(tmp_path, capsys):
    b = _bench()
    layout, writes, reqs = b.measure(_log(tmp_path / "a.events.jsonl", "like:llama-3.1-8b-p64-bf16"))
    assert layout == "like:llama-3.1-8b-p64-bf16" and [w["tokens"] for w in writes] == [128, 192]
    assert reqs == [{"rid": "r1", "transfer_s": 1.0, "unwritten_s": 2.0}]
    _log(tmp_path / "b.events.jsonl", "like:deepseek-v3-p64-bf16", write_s=1.0)
    rows = b.summarize([tmp_path / "a.events.jsonl", tmp_path / "b.events.jsonl"])
    assert rows["like:llama-3.1-8b-p64-bf16"]["bytes_per_token"] == 131_072
    assert rows["like:deepseek-v3-p64-bf16"]["transfer_ms"]["p50"] == 2000.0
    assert b.main([str(tmp_path / "a.events.jsonl"), str(tmp_path / "b.events.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "like:deepseek-v3-p64-bf16" in out and "transfer_ms x2.0" in out


def test_histories_without_a_write_say_so(tmp_path):
    b = _bench()
    (tmp_path / "x.events.jsonl").write_text(json.dumps({"ev": "experiment", "layout": {"kv_layout": "mha-p1-fp32"}}) + "\n")
    with pytest.raises(SystemExit, match="no KV write recorded in 1 histories"):
        b.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="no such file"):
        b.main([str(tmp_path / "missing")])

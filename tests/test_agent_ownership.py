"""The page-ownership ledger (``faults/agent/ownership.py``) against SGLang's real allocators on CPU.

One subprocess, shared with tests/test_agent_paged.py (tests/sglang_allocator_scripts.py), boots the agent
as in a decode process (``KVCHAOS_AGENT_ROLE=decode``: the allocators are hooked by the agent's own import
machinery) and drives SGLang's real page-size-1 and paged allocators
through decode's real pre-allocation (``alloc_for_decode_prealloc``) and release paths
(``free_kv_row_segments``, ``free`` inside and outside a free group, ``free_page_ids``, ``clear``), with a
stand-in ``DecodePreallocQueue._pre_alloc`` (the request's slots written into ``req_to_token``, as 0.5.23's
does) for the page-table view. It prints the ledger's ``page_conflict`` events per scenario; the tests
below judge them: none on a correct engine's paths, and the conflict — with both holders — where a page is
handed out twice, released twice, or pointed at by two live requests' page tables."""

from __future__ import annotations

import pytest

from kvchaos import oracles


@pytest.fixture(scope="module")
def seen(sglang_allocators):
    return sglang_allocators["ownership"]


@pytest.mark.parametrize("ps", [1, 16])
def test_a_correct_engines_paths_raise_no_conflict(seen, ps):
    """Pre-allocation, release row by row and in a free group, pages reused, the same request again, clear()."""
    r = seen[f"clean-p{ps}"]
    assert r["conflicts"] == [], r


@pytest.mark.parametrize("ps", [1, 16])
def test_a_page_released_twice_is_a_double_free_naming_its_last_holder(seen, ps):
    c = seen[f"double_free-p{ps}"]["conflicts"]
    assert c and {x["conflict"] for x in c} == {"double_free"} and {x["holder"] for x in c} == {"x"}, c


@pytest.mark.parametrize("ps", [1, 16])
def test_a_page_handed_out_while_held_is_caught_at_the_allocation_and_in_the_page_table(seen, ps):
    c = seen[f"double_alloc-p{ps}"]["conflicts"]
    kinds = {x["conflict"] for x in c}
    assert "double_assign" in kinds and "two_holders" in kinds, c
    pair = [x for x in c if x["conflict"] == "two_holders"]
    assert all((x["holder"], x["to"]) == ("x", "y") for x in pair), pair
    assert sum(x["n_pages"] for x in pair) == 32 // ps  # the aliased pages, each named once
    assert "double_free" not in kinds  # the mutation keeps the pool whole: only the sharing is wrong


@pytest.mark.parametrize("ps", [1, 16])
def test_two_page_tables_on_one_page_are_caught_though_the_allocator_never_saw_it(seen, ps):
    c = seen[f"row_alias-p{ps}"]["conflicts"]
    assert c and all(x["conflict"] == "two_holders" and (x["holder"], x["to"]) == ("x", "y") for x in c), c


# ------------------------------------------------------------------ the checker over the ledger's events
def _agent(ev, **f):
    return {"ev": "agent", "agent_ev": ev, "source": "agent", "wall": 100.5, "role": "decode", "pid": 7, **f}


def test_page_ownership_fails_on_a_conflict_and_names_both_holders():
    ev = [{"ev": "experiment", "id": "x", "wall": 100.0},
          _agent("kv_prealloc", rid="a", ledger={"handed": 10, "claimed": 10}),
          _agent("page_conflict", conflict="two_holders", page=42, holder="a", to="b", where="_pre_alloc", seq=9)]
    v = oracles.page_ownership(ev)
    assert v.status == "fail" and v.witnesses[0]["holder"] == "a" and v.witnesses[0]["to"] == "b", v
    assert "two_holders of page 42" in v.summary and "0.50 s into the experiment" in v.summary


def test_page_ownership_passes_with_the_ledgers_evidence_and_is_unknown_without():
    ev = [{"ev": "experiment", "id": "x"}, _agent("kv_prealloc", rid="a", ledger={"handed": 10, "claimed": 10})]
    assert oracles.page_ownership(ev).status == "pass"
    assert oracles.page_ownership([{"ev": "experiment", "id": "x"}, _agent("kv_prealloc", rid="a")]).status == "unknown"


def test_page_ownership_names_holders_by_the_clients_rid():
    """An OpenAI route reaches decode under an id of decode's own: decode's record of the request's canaries
    names it back (kvchaos.history.History.engine_rids)."""
    c = "[ABCDEFGHIJ]"
    ev = [{"ev": "experiment", "id": "x"}, {"ev": "plan", "rid": "client-1", "tenant": "t", "canaries": [c]},
          _agent("kv_prealloc", rid="eng-9", canaries=[c], ledger={"handed": 1}),
          _agent("page_conflict", conflict="two_holders", page=3, holder="eng-9", to="other", where="_pre_alloc")]
    assert oracles.page_ownership(ev).witnesses[0]["holder"] == "client-1"


def test_conflicts_past_the_event_cap_are_still_a_fail():
    """Past its event cap the ledger counts conflicts: a count that grew during the experiment is a FAIL."""
    ev = [{"ev": "experiment", "id": "x"},
          _agent("kv_prealloc", rid="a", pid=7, ledger={"handed": 10, "suppressed": 3}),
          _agent("kv_prealloc", rid="b", pid=7, ledger={"handed": 20, "suppressed": 9})]
    v = oracles.page_ownership(ev)
    w = v.witnesses[0]
    assert v.status == "fail" and w["conflict"] == "suppressed" and "6 page conflict" in w["problem"]
    ev[2]["ledger"]["suppressed"] = 3
    assert oracles.page_ownership(ev).status == "pass"

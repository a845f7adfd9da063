"""The detection matrix's witness rule for double_alloc: a reply decoded over two requests' mixed KV may
recite a canary neither minted; it names the A/B pair only when the recital is made of their canaries."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

_spec = importlib.util.spec_from_file_location(
    "matrix_suite", Path(__file__).resolve().parents[1] / "suites" / "test_detection_matrix.py")
matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(matrix)

A, B = "xsm0740-000001-t000", "xsm0740-000002-t001"
PLANS = {A: SimpleNamespace(canaries=["[ZCEFUDKP7X]", "[464EOQ6CAY]", "[MMTZ2G3WTD]"]),
         B: SimpleNamespace(canaries=["[MQQ57QE6BN]", "[LIGES3D7CW]", "[EZUFTGBDZ2]"])}


def _w(matched, victim=A, origin="unknown"):
    return {"victim_rid": victim, "origin": origin, "matched": matched}


def test_a_splice_of_the_pairs_canaries_names_the_pair():
    # fresh clone of 2026-12-07 (run 24): A's own 'MMTZ2G3', then 'DZ2' where B's 'EZUFTGBDZ2' has it
    assert matrix._spliced_from_other(_w("MMTZ2G3DZ2"), PLANS)
    # the reverse, B's first pages then A's own
    assert matrix._spliced_from_other(_w("EZUFTGBWTD"), PLANS)
    # 2026-12-06: a run of five of B's canary after A's own 'ZCEF'
    assert matrix._spliced_from_other(_w("ZCEFTGBDZ2"), PLANS)
    # B the victim of A's KV
    assert matrix._spliced_from_other(_w("EZUFTGBWTD", victim=B), PLANS)


def test_what_is_not_made_of_the_pairs_canaries_does_not():
    assert not matrix._spliced_from_other(_w("QQQQQQQQQQ"), PLANS)  # nobody's
    assert not matrix._spliced_from_other(_w("MMTZ2G3QQQ"), PLANS)  # A's own, then nobody's
    assert not matrix._spliced_from_other(_w("MMTZ2G3WZ2"), PLANS)  # two of B's characters only
    assert not matrix._spliced_from_other(_w("MMTZDZ2WTD"), PLANS)  # B's characters, not one run to the end
    assert not matrix._spliced_from_other(_w("DZ2MMTZ2G3"), PLANS)  # B's characters, not where B has them
    assert not matrix._spliced_from_other(_w("MMTZ2G3DZ2", origin="owner"), PLANS)  # an owner is named instead
    assert not matrix._spliced_from_other(_w("MMTZ2G3DZ2", victim="xsm0740-000003-t002"), PLANS)  # not the pair

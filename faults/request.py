"""Request-level faults: change what a request carries, and record that they did.

``plant_leak(victim, donor, log)`` feeds the donor tenant's prompt text (with its canaries) into the
victim's prompt, just before the victim's trailing filler and trigger — what a KV cross-wiring
would make decode attend to. It emits a ``fault`` event naming victim, donor and the planted
canaries, so a run can prove the fault fired and an oracle can be checked against it: the
isolation oracle must then FAIL with a witness whose victim is ``victim.rid`` and whose owner is
``donor.rid``.
"""

from __future__ import annotations

from kvchaos.probe import MIN_TAIL, TRIGGER


def plant_leak(victim, donor, log=None) -> dict:
    if victim.rid == donor.rid:
        raise ValueError("plant_leak: victim and donor must be different requests")
    if not victim.prompt.endswith(TRIGGER) or not donor.prompt.endswith(TRIGGER):
        raise ValueError("plant_leak: both plans must carry probe prompts (ending in the trigger)")
    donor_text = donor.prompt[:-1]
    head, tail = victim.prompt[:-1 - MIN_TAIL], victim.prompt[-1 - MIN_TAIL:]
    victim.prompt = head + " " + donor_text + " " + tail
    victim.n_tokens = len(victim.prompt)
    # the victim keeps the budget its own plan gave it (room for two foreign canaries beyond its own,
    # kvchaos.probe.max_new_tokens): a planted leak is seen with exactly what a real victim gets
    victim.extra["planted_from"] = donor.rid
    rec = {"type": "planted_leak", "victim": victim.rid, "donor": donor.rid, "donor_tenant": donor.tenant,
           "victim_tenant": victim.tenant, "canaries": list(donor.canaries)}
    if log is not None:
        log.emit("fault", **rec)
    return rec


def expect_caught(verdict, fault: dict) -> tuple[bool, str]:
    """Did the isolation verdict catch this planted leak, with the right witness?"""
    if verdict.status != "fail":
        return False, f"isolation verdict is {verdict.status!r}, expected 'fail' for the planted leak"
    for w in verdict.witnesses:
        if w["victim_rid"] == fault["victim"] and w["owner_rid"] == fault["donor"] and w["canary"] in fault["canaries"]:
            return True, f"caught: {w['victim_rid']} got {w['matched']!r} of {w['owner_rid']}"
    return False, f"isolation failed but no witness names victim {fault['victim']} and owner {fault['donor']}"

"""``kvchaos fuzz``: search for what no suite names.

Scenarios as data (:mod:`kvchaos.workload.scenario`) are drawn from a weighted grammar and mutated
(:mod:`.grammar`), run on reused clusters grouped by deployment (:mod:`.loop`), kept when the engines'
own events show a state not seen before (:mod:`.feedback`, :mod:`.corpus`), and every verdict that is not
PASS is triaged against the findings registry as KNOWN or NEW, deduplicated by mechanism and confirmed
by reruns and a control (:mod:`.triage`). docs/reference/scenarios-and-fuzzing.md has the whole story.
"""

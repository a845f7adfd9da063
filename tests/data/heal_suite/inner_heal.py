def test_arms_then_fails(faults):
    faults.net.toxic("client", "latency", latency=1000)
    assert faults.net.armed()
    raise AssertionError("planted failure with a toxic armed")


def test_next_test_starts_clean(faults):
    assert faults.net.armed() == []

import pytest

# tests/data holds inner suites that tests run in a subprocess; never collect them directly
collect_ignore_glob = ["data/*"]


@pytest.fixture(scope="session")
def sglang_allocators(tmp_path_factory):
    """What tests/test_agent_paged.py's and tests/test_agent_ownership.py's scripts saw against SGLang's real
    allocators, from one child (tests/sglang_allocator_scripts.py): {"paged": ..., "ownership": ...}; once
    per session, its xdist workers included (the child's SGLang import is ~10 s of CPU)."""
    from tests.sglang_allocator_scripts import driver
    from tests.util import agent_process_result, once_per_session

    return once_per_session(tmp_path_factory, "sglang-allocators",
                            lambda: agent_process_result(driver(), tmp_path_factory.mktemp("sglang-allocators")))

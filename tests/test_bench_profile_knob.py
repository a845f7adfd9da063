"""bench/profile_knob.py sets one [cluster.env] knob in a copy of the CPU profile; bad input is named."""

import tomllib
from pathlib import Path

import pytest

from tests.util import load_file

REPO = Path(__file__).resolve().parents[1]


def _bench():
    return load_file(REPO / "bench" / "profile_knob.py", "profile_knob_bench")


def test_a_knob_is_replaced_where_set_and_added_where_not():
    b = _bench()
    text = b.PROFILE.read_text()
    env = tomllib.loads(text)["cluster"]["env"]
    assert env["KVCHAOS_PARKED_POLL_MS"] == "4" and "KVCHAOS_TRANSFER_WAIT_NICE" not in env
    got = tomllib.loads(b.profile_with("KVCHAOS_PARKED_POLL_MS", "1", text))
    assert got["cluster"]["env"] == {**env, "KVCHAOS_PARKED_POLL_MS": "1"}
    added = tomllib.loads(b.profile_with("KVCHAOS_TRANSFER_WAIT_NICE", "19", text))
    assert added["cluster"]["env"] == {**env, "KVCHAOS_TRANSFER_WAIT_NICE": "19"}
    assert added["policy"] == tomllib.loads(text)["policy"]  # the rest of the profile is the profile


@pytest.mark.parametrize("argv, msg", [(["lower_case", "0", "1"], "is not an environment variable name"),
                                       (["KNOB", "0", "1", "--pairs", "0"], "--pairs must be >= 1")])
def test_bad_arguments_are_named(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        _bench().main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err

"""bench/ci_time.py leaves the shared venv's editable kvchaos where it found it: the fresh clone's
``make setup`` re-points it at the clone, which the bench deletes after the run."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("ci_time_bench", REPO / "bench" / "ci_time.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("fails", [False, True])
def test_the_venv_points_back_at_the_checkout_it_pointed_at_before_the_run(tmp_path, monkeypatch, fails):
    b = _bench()
    where = {"now": tmp_path}  # the checkout the venv points at
    reinstalled = []

    def run(repo, keep, i):
        where["now"] = tmp_path / "clone"  # what the clone's make setup does
        if fails:
            raise RuntimeError("make test crashed")
        return {"run": i}

    monkeypatch.setattr(b, "_one_run", run)
    monkeypatch.setattr(b, "installed_from", lambda: where["now"])
    monkeypatch.setattr(b, "reinstall", lambda p: (reinstalled.append(p), where.update(now=p)))
    if fails:
        with pytest.raises(RuntimeError):
            b.one_run(REPO, None, 1)
    else:
        assert b.one_run(REPO, None, 1) == {"run": 1}
    assert reinstalled == [tmp_path] and where["now"] == tmp_path


def test_a_venv_left_where_it_was_is_not_reinstalled(tmp_path, monkeypatch):
    b = _bench()
    reinstalled = []
    monkeypatch.setattr(b, "_one_run", lambda repo, keep, i: {"run": i})
    monkeypatch.setattr(b, "installed_from", lambda: tmp_path)
    monkeypatch.setattr(b, "reinstall", reinstalled.append)
    b.one_run(REPO, None, 1)
    assert reinstalled == []

"""rlkit/gcpolicy.py: a set-up runs without automatic garbage collection, and the collector's state comes back
(tests/trainer/test_e2e.py: the trainer's set-up runs under it, its loop with the collector on)."""

import gc

import pytest

from rlkit.gcpolicy import setup_phase


def _cycles(n: int) -> list:
    """n reference cycles (containers the collector tracks), kept alive by the returned list."""
    kept = []
    for _ in range(n):
        a: list = []
        a.append(a)
        kept.append(a)
    return kept


@pytest.fixture
def collections():
    """The generations of the collections that start while the test runs."""
    seen = []

    def spy(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(spy)
    yield seen
    gc.callbacks.remove(spy)


def test_no_automatic_collection_runs_inside_and_the_collector_is_back_after(collections):
    assert gc.isenabled()
    _cycles(20 * gc.get_threshold()[0])  # outside: the allocations trigger young collections
    assert collections, "no collection outside the set-up: the spy sees nothing"
    with setup_phase():
        assert not gc.isenabled()
        # Cleared in here: building the context manager allocates while the collector is still on, and where an
        # earlier test left the allocation count one short of the threshold, a young collection starts there.
        collections.clear()
        kept = _cycles(20 * gc.get_threshold()[0])
        assert collections == []
        gc.collect()  # an explicit collection still runs (vLLM's before it measures free memory)
        assert collections == [2]
    assert gc.isenabled() and len(kept) > 0


def test_the_state_comes_back_after_an_error_and_stays_off_where_it_was_off():
    with pytest.raises(RuntimeError, match="set-up failed"):
        with setup_phase():
            raise RuntimeError("set-up failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with setup_phase():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()

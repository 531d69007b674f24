"""`timing_helpers.within`: a wall-clock bound grows with the machine's load, and stays under the bug's time."""

import os

import pytest
import timing_helpers
from timing_helpers import slowdown, within


def test_a_bound_grows_with_the_load_and_stays_under_the_bugs_time(monkeypatch):
    monkeypatch.delenv("RLKIT_TEST_SLOWDOWN", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))  # idle: the bound as written
    assert slowdown() == 1.0 and within(30, failure_s=300) == 30
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 8.0, 7.0))  # 4.5 runnable tasks per core
    assert slowdown() == pytest.approx(4.5)
    assert within(30, failure_s=300) == pytest.approx(135.0)  # 30 x 4.5
    assert within(20, failure_s=60) == pytest.approx(48.0)  # 90 capped at 0.8 x 60
    monkeypatch.setenv("RLKIT_TEST_SLOWDOWN", "2")
    assert within(30, failure_s=300) == 60.0
    assert timing_helpers.MARGIN * 60 < 60  # a capped bound still fails when the bug's time is back

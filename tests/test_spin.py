"""The owner's idle spin (``kvshm.owner.spin``): it busy-polls only while recent gaps between
frames were short, for a bounded multiple of them, and sleeps at once otherwise."""
from __future__ import annotations

import pytest

from kvshm.owner.spin import PAYS_S, SPAN, SPIN_MAX_S, SpinPolicy


def test_a_chatty_client_gets_a_spin_bounded_by_its_gaps():
    p = SpinPolicy()
    for _ in range(8):
        p.observe(20e-6)  # round trips back to back
    assert p.budget(0.0) == pytest.approx(SPAN * 20e-6)
    assert p.budget(SPAN * 20e-6) == 0.0  # already idle that long: sleep
    for _ in range(8):
        p.observe(PAYS_S)
    assert p.budget(0.0) == SPIN_MAX_S  # never longer than the cap


def test_an_engine_sending_a_few_frames_per_step_makes_the_owner_sleep_at_once():
    p = SpinPolicy()
    for gap in [3e-3, 30e-6, 8e-3, 4e-3, 25e-6, 6e-3, 5e-3, 40e-6]:  # steps ms apart
        p.observe(gap)
    assert p.budget(0.0) == 0.0


def test_the_policy_follows_the_recent_gaps_both_ways():
    p = SpinPolicy()
    assert p.budget(0.0) > 0  # a new owner spins (a client has just connected)
    for _ in range(5):
        p.observe(0.2)  # idle: long gaps
    assert p.budget(0.0) == 0.0
    for _ in range(5):  # a burst starts: after a majority of short gaps, spin again
        p.observe(50e-6)
    assert p.budget(0.0) == pytest.approx(SPAN * 50e-6)

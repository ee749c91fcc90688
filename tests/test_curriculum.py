"""The curriculum task source moves up on high success, down on low success, and resumes."""

from __future__ import annotations

import json

import pytest

from mentorrl.train.curriculum import Curriculum

LEVELS = [[f"easy-{i}" for i in range(5)], [f"mid-{i}" for i in range(5)], [f"hard-{i}" for i in range(3)]]


def test_raises_and_lowers_difficulty_on_windowed_success():
    c = Curriculum(LEVELS, raise_above=0.6, lower_below=0.2, window=10)
    assert all(t.startswith("easy") for t in c.sample(4))
    assert c.observe([True] * 9) == 0  # the window is not full yet
    assert c.observe([True]) == 1 and c.outcomes.maxlen == 10 and not c.outcomes  # up, window restarts
    assert all(t.startswith("mid") for t in c.sample(8)) and len(c.sample(8)) == 8
    assert c.observe([True, False] * 5) == 1  # 50%: stays
    assert c.observe([False] * 10) == 0  # the window slides: after 7 failures it holds 1 success in 10: down
    assert c.history == [(10, 1), (27, 0)] and list(c.outcomes) == [False] * 3  # level 0's window restarted
    c.level = 2
    c.outcomes.clear()
    assert c.observe([True] * 10) == 2  # the top level is a ceiling


def test_state_round_trips_through_json():
    a = Curriculum(LEVELS, window=4, seed=5)
    a.observe([True] * 4)
    a.observe([True, False])
    b = Curriculum(LEVELS, window=4, seed=99)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (b.level, list(b.outcomes), b.history) == (a.level, list(a.outcomes), a.history)
    assert b.sample(3) == a.sample(3)


def test_bad_settings():
    with pytest.raises(ValueError):
        Curriculum([])
    with pytest.raises(ValueError):
        Curriculum(LEVELS, raise_above=0.2, lower_below=0.5)
    with pytest.raises(ValueError):
        Curriculum(LEVELS, start=3)
    with pytest.raises(ValueError):
        Curriculum([["a"], []])

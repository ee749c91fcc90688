"""The persistent replay buffer: persistence, eviction, sampling, admission, hybrid batches, segments."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest
from pydantic import ValidationError

from mentorrl.replay import (
    REJECT_DUPLICATE,
    REJECT_LOW_ADVANTAGE,
    REJECT_LOW_REWARD,
    REJECT_TOO_LONG,
    ReplayBuffer,
    ReplayConfig,
    apportion,
    hybrid_batch,
    segment_replay,
)
from mentorrl.trajectory import RewardBreakdown, Segment, Trajectory


def traj(
    i: int | str,
    *,
    success: bool = False,
    reward: float | None = None,
    version: int = 0,
    task: str | None = None,
    policy_tokens: int = 2,
    source: str = "policy",
) -> Trajectory:
    """A small valid trajectory: a 3-token prompt then ``policy_tokens`` generated tokens."""
    n = 3 + policy_tokens
    return Trajectory(
        id=f"t-{i}",
        task_id=task or f"task-{i}",
        family="refund",
        token_ids=list(range(1, n + 1)),
        loss_mask=[0, 0, 0] + [1] * policy_tokens,
        logprobs=[0.0, 0.0, 0.0] + [-0.5] * policy_tokens,
        segments=[Segment(role="prompt", start=0, end=3), Segment(role="policy", start=3, end=n)],
        policy_version=version,
        env_name="orders",
        env_version="1.0",
        source=source,
        reward=RewardBreakdown(success=success, total=(1.0 if success else 0.0) if reward is None else reward),
    )


@pytest.fixture
def path(tmp_path):
    return tmp_path / "replay.sqlite"


def test_restart_gives_back_same_contents(path):
    cfg = ReplayConfig(capacity=100)
    trajs = [traj(i, success=i % 2 == 0, version=i) for i in range(10)]
    with ReplayBuffer(path, cfg) as buf:
        for t in trajs:
            assert buf.add(t).admitted
        buf.mark_hard(["task-3"])
        assert buf.add(trajs[0]).reason == REJECT_DUPLICATE
        before = buf.stats()
    with ReplayBuffer(path, cfg) as buf:
        assert buf.trajectories() == [buf.get(t.id) for t in trajs] == trajs
        assert buf.stats() == before
        assert buf.hard_tasks() == {"task-3"}
        assert buf.category_of("t-3") == "hard"
        assert buf.stats().rejections == {REJECT_DUPLICATE: 1}


def test_duplicate_id_is_a_reported_noop(path):
    with ReplayBuffer(path) as buf:
        assert buf.add(traj(1)).admitted
        res = buf.add(traj(1, success=True))
        assert not res and res.reason == REJECT_DUPLICATE
        assert len(buf) == 1 and buf.category_of("t-1") == "failure"


def test_capacity_evicts_oldest(path):
    with ReplayBuffer(path, ReplayConfig(capacity=3)) as buf:
        evicted = []
        for i in range(5):
            evicted += buf.add(traj(i)).evicted
        assert evicted == ["t-0", "t-1"]
        assert buf.ids() == ["t-2", "t-3", "t-4"]
        # re-adding an evicted id is a fresh insert, and evicts the now-oldest
        assert buf.add(traj(0)).evicted == ("t-2",)
        assert buf.ids() == ["t-3", "t-4", "t-0"]
    # reopening with a smaller capacity trims on open
    with ReplayBuffer(path, ReplayConfig(capacity=1)) as buf:
        assert buf.ids() == ["t-0"]


def test_categories_and_mark_hard(path):
    with ReplayBuffer(path) as buf:
        buf.add(traj(0, success=True))
        buf.add(traj(1, success=False))
        buf.add(traj(2, success=True), category="hard")
        assert buf.mark_hard(["task-0", "task-9"]) == 1
        buf.add(traj("9b", task="task-9", success=True))
        assert [buf.category_of(i) for i in ("t-0", "t-1", "t-2", "t-9b")] == ["hard", "failure", "hard", "hard"]
        assert buf.stats().by_category == {"success": 0, "failure": 1, "hard": 3}
        with pytest.raises(ValueError):
            buf.add(traj(5), category="bogus")  # type: ignore[arg-type]


def test_category_weights_dominate_seeded_sampling(path):
    cfg = ReplayConfig(category_weights={"success": 1.0, "failure": 0.01, "hard": 1.0})
    with ReplayBuffer(path, cfg) as buf:
        for i in range(20):
            buf.add(traj(i, success=i < 10))
        a = buf.sample(400, rng=random.Random(7), replace=True)
        b = buf.sample(400, rng=random.Random(7), replace=True)
        assert [t.id for t in a] == [t.id for t in b]  # deterministic given the rng
        wins = sum(t.reward.success for t in a)
        assert wins > 380  # expected ~396
        # without replacement: distinct entries, the successes drawn first
        first = buf.sample(10, rng=random.Random(1))
        assert len({t.id for t in first}) == 10 and sum(t.reward.success for t in first) >= 8
        assert len(buf.sample(100, rng=random.Random(1))) == 20
    zero = ReplayConfig(category_weights={"failure": 0.0})
    with ReplayBuffer(path, zero) as buf:
        assert all(t.reward.success for t in buf.sample(50, rng=random.Random(0), replace=True))
        assert len(buf.sample(50, rng=random.Random(0))) == 10


def test_staleness_decay_and_cutoff(path):
    cfg = ReplayConfig(staleness_decay=0.5, max_staleness=3)
    with ReplayBuffer(path, cfg) as buf:
        for v in range(6):
            buf.add(traj(v, version=v, success=True))
        assert buf.entry_weight("success", 5, 5) == 1.0
        assert buf.entry_weight("success", 3, 5) == 0.25
        assert buf.entry_weight("success", 1, 5) == 0.0  # age 4 > max_staleness 3
        assert buf.entry_weight("success", 1, None) == 1.0
        got = Counter(t.policy_version for t in buf.sample(2000, current_version=5, rng=random.Random(3), replace=True))
        assert set(got) == {2, 3, 4, 5}
        assert got[5] > got[4] > got[3] > got[2]
        assert {t.policy_version for t in buf.sample(10, current_version=5, rng=random.Random(0))} == {2, 3, 4, 5}
        assert buf.sample(10, current_version=20, rng=random.Random(0)) == []
        assert len(buf.sample(10, rng=random.Random(0))) == 6  # no current version: staleness ignored


def test_admission_min_reward(path):
    with ReplayBuffer(path, ReplayConfig(min_reward=0.5)) as buf:
        res = buf.add(traj(0, reward=0.2))
        assert not res and res.reason == REJECT_LOW_REWARD
        assert buf.add(traj(1, reward=0.5)).admitted
        no_reward = traj(2).model_copy(update={"reward": None})
        assert buf.add(no_reward).reason == REJECT_LOW_REWARD  # counts as 0.0
        assert buf.stats().rejections == {REJECT_LOW_REWARD: 2}


def test_admission_max_tokens_unless_success(path):
    with ReplayBuffer(path, ReplayConfig(max_tokens=4)) as buf:
        assert buf.add(traj(0, policy_tokens=5)).reason == REJECT_TOO_LONG
        assert buf.add(traj(1, policy_tokens=5, success=True)).admitted
        assert buf.add(traj(2, policy_tokens=4)).admitted
        assert buf.ids() == ["t-1", "t-2"]


def test_admission_advantage_threshold(path):
    with ReplayBuffer(path, ReplayConfig(advantage_threshold=0.1)) as buf:
        assert buf.add(traj(0), advantage=0.05).reason == REJECT_LOW_ADVANTAGE
        assert buf.add(traj(1), advantage=-0.05).reason == REJECT_LOW_ADVANTAGE
        assert buf.add(traj(2), advantage=-0.2).admitted
        assert buf.add(traj(3)).admitted  # no advantage given: filter not applied
        s = buf.stats()
        assert s.rejections == {REJECT_LOW_ADVANTAGE: 2} and s.size == 2
    with pytest.raises(ValidationError):
        ReplayConfig(category_weights={"weird": 1.0})
    with pytest.raises(ValidationError):
        ReplayConfig(category_weights={"hard": -1.0})


def test_concurrent_writer_and_reader(path):
    n = 150
    with ReplayBuffer(path, ReplayConfig(capacity=1000)) as buf:
        errors: list[BaseException] = []
        done = threading.Event()
        sample_sizes: list[int] = []

        def writer():
            try:
                for i in range(n):
                    assert buf.add(traj(i, success=i % 3 == 0)).admitted
            except BaseException as e:  # noqa: BLE001 - surfaced below
                errors.append(e)
            finally:
                done.set()

        def reader():
            rng = random.Random(0)
            try:
                while not done.is_set():
                    got = buf.sample(20, rng=rng)  # every row parses into a valid Trajectory
                    assert len({t.id for t in got}) == len(got)
                    assert all(t.token_ids == list(range(1, 6)) for t in got)
                    sample_sizes.append(len(got))
                    buf.stats()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not errors, errors
        assert sample_sizes  # the reader did run
        ids = buf.ids()
        assert len(ids) == n and sorted(ids) == sorted(f"t-{i}" for i in range(n))
    with ReplayBuffer(path) as buf:
        assert Counter(buf.ids()) == Counter(f"t-{i}" for i in range(n))


def test_apportion_largest_remainder():
    assert apportion(10, {"online": 0.5, "expert": 0.2, "replay": 0.3}) == {"online": 5, "expert": 2, "replay": 3}
    # 7 * (1/3 each) = 2.33: one leftover unit, ties go to the first source in order
    assert apportion(7, {"online": 1, "expert": 1, "replay": 1}) == {"online": 3, "expert": 2, "replay": 2}
    assert apportion(5, {"replay": 2.0}) == {"online": 0, "expert": 0, "replay": 5}
    with pytest.raises(ValueError):
        apportion(5, {"online": 0.0})
    with pytest.raises(ValueError):
        apportion(5, {"teacher": 1.0})


def test_hybrid_batch_ratios(path):
    online = [traj(f"on{i}", version=4) for i in range(20)]
    expert = [traj(f"ex{i}", success=True, source="expert") for i in range(20)]
    with ReplayBuffer(path) as buf:
        for i in range(20):
            buf.add(traj(f"rp{i}", version=3))
        ratios = {"online": 0.5, "expert": 0.25, "replay": 0.25}
        batch = hybrid_batch(online, expert, buf, ratios, 10, 4, random.Random(0))
        assert len(batch) == 10
        assert Counter(b.source for b in batch) == {"online": 5, "expert": 3, "replay": 2}
        for b in batch:
            assert b.trajectory.id.startswith({"online": "t-on", "expert": "t-ex", "replay": "t-rp"}[b.source])
        assert len({b.trajectory.id for b in batch}) == 10
        again = hybrid_batch(online, expert, buf, ratios, 10, 4, random.Random(0))
        assert [b.trajectory.id for b in again] == [b.trajectory.id for b in batch]
        # a short source is topped up by the others, largest ratio first
        short = hybrid_batch(online, expert[:1], buf, ratios, 12, 4, random.Random(0))
        assert len(short) == 12 and Counter(b.source for b in short) == {"online": 8, "expert": 1, "replay": 3}
        # zero-ratio sources are never used; not enough data: everything available
        few = hybrid_batch(online[:2], expert, buf, {"online": 1.0}, 5, 4, random.Random(0))
        assert [b.source for b in few] == ["online", "online"]
    # no buffer: replay share is filled by the other sources
    nobuf = hybrid_batch(online, expert, None, ratios, 8, 4, random.Random(0))
    assert len(nobuf) == 8 and "replay" not in {b.source for b in nobuf}


def _long_traj() -> Trajectory:
    # prompt [0,3) policy [3,5) obs [5,7) policy [7,9) obs [9,10) policy [10,12)
    segs = [
        ("prompt", 0, 3),
        ("policy", 3, 5),
        ("observation", 5, 7),
        ("policy", 7, 9),
        ("observation", 9, 10),
        ("policy", 10, 12),
    ]
    mask = [0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 1, 1]
    return Trajectory(
        id="long",
        task_id="task-L",
        family="refund",
        token_ids=list(range(100, 112)),
        loss_mask=mask,
        logprobs=[-0.1 * (j + 1) if m else 0.0 for j, m in enumerate(mask)],
        segments=[Segment(role=r, start=s, end=e) for r, s, e in segs],
        policy_version=2,
        env_name="orders",
        env_version="1.0",
        num_turns=3,
        reward=RewardBreakdown(success=True, total=1.0),
    )


def test_segment_replay_one_window_per_turn():
    t = _long_traj()
    snapshot = t.model_dump()
    segs = segment_replay(t)
    assert t.model_dump() == snapshot  # pure
    assert [s.id for s in segs] == ["long#seg0", "long#seg1", "long#seg2"]
    assert [len(s.token_ids) for s in segs] == [5, 9, 12]
    assert segs[0].loss_mask == [0, 0, 0, 1, 1]
    assert segs[1].loss_mask == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert segs[2].loss_mask == [0] * 10 + [1, 1]
    for s in segs:
        assert s.token_ids == t.token_ids[: len(s.token_ids)]  # the prefix is kept as context
        assert len(s.token_ids) == len(s.loss_mask) == len(s.logprobs)
        assert all((lp != 0.0) == bool(m) for lp, m in zip(s.logprobs, s.loss_mask))
        assert all(lp == t.logprobs[j] for j, lp in enumerate(s.logprobs) if s.loss_mask[j])
        assert s.segments[-1].end == len(s.token_ids) and s.reward == t.reward
    # together the windows cover every policy token exactly once
    assert sum(s.num_policy_tokens for s in segs) == t.num_policy_tokens
    # two turns per window; short trajectories and single windows come back untouched
    two = segment_replay(t, turns_per_segment=2)
    assert [s.loss_mask for s in two] == [[0, 0, 0, 1, 1, 0, 0, 1, 1], [0] * 10 + [1, 1]]
    assert segment_replay(t, min_tokens=12) == [t]
    assert segment_replay(t, turns_per_segment=3) == [t]
    # without segments, policy turns come from runs of loss_mask 1
    bare = t.model_copy(update={"segments": []})
    assert [s.loss_mask for s in segment_replay(bare)] == [s.loss_mask for s in segs]
    with pytest.raises(ValueError):
        segment_replay(t, turns_per_segment=0)


WRITER = """
import os, sys
sys.path.insert(0, {tests!r})
from test_replay import traj
from mentorrl.replay import ReplayBuffer, ReplayConfig
buf = ReplayBuffer({path!r}, ReplayConfig(capacity=100))
for i in range(12):
    buf.add(traj(i, success=i % 3 == 0, version=i))
buf.mark_hard(["task-4"])
os._exit(0)  # no close(): the process just ends, as a killed one would
"""


def test_buffer_persists_across_processes(path):
    """Another process fills the buffer and ends without closing it; this one reads it all back."""
    import subprocess
    import sys
    from pathlib import Path

    code = WRITER.format(tests=str(Path(__file__).parent), path=str(path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    with ReplayBuffer(path, ReplayConfig(capacity=100)) as buf:
        assert buf.ids() == [f"t-{i}" for i in range(12)]
        assert buf.get("t-5") == traj(5, success=False, version=5)
        assert buf.hard_tasks() == {"task-4"}
        assert buf.stats().by_category == {"success": 4, "failure": 7, "hard": 1}  # t-4 was re-filed as hard


def test_priority_proportions_match_the_weights(path):
    """Draws with replacement land in each category in proportion to count x weight (chi-square, fixed seed)."""
    cfg = ReplayConfig(category_weights={"success": 3.0, "failure": 1.0, "hard": 6.0})
    with ReplayBuffer(path, cfg) as buf:
        for i in range(30):
            cat = ("success", "failure", "hard")[i % 3]
            buf.add(traj(i, success=cat == "success"), category=cat)
        n = 20_000
        drawn = Counter(buf.category_of(t.id) for t in buf.sample(n, rng=random.Random(12345), replace=True))
    expected = {"success": 0.3 * n, "failure": 0.1 * n, "hard": 0.6 * n}  # 10 entries each: weights 3:1:6
    chi2 = sum((drawn[c] - e) ** 2 / e for c, e in expected.items())
    assert chi2 < 13.82, (drawn, chi2)  # the 0.999 quantile of chi-square with 2 degrees of freedom
    assert abs(drawn["hard"] / n - 0.6) < 0.02


# ------------------------------------------------------------- rollback and bad files -------
def _state(buf: ReplayBuffer):
    return buf.ids(), [t.policy_version for t in buf.trajectories()], buf.stats()


def test_rollback_restores_the_marked_state_exactly():
    """Property: whatever was added (evictions and rejections included) after a mark, a rollback to
    it gives back the same entries, order, counts; twice in a row (a second crash) too."""
    import tempfile
    from pathlib import Path

    from hypothesis import given, settings
    from hypothesis import strategies as st

    op = st.tuples(st.integers(0, 30), st.booleans())  # (trajectory number: repeats are duplicates, success)

    @settings(max_examples=60, deadline=None)
    @given(st.integers(1, 6), st.lists(op, max_size=12), st.lists(op, max_size=12), st.lists(op, max_size=6))
    def check(capacity, before, after, again):
        with (
            tempfile.TemporaryDirectory() as d,
            ReplayBuffer(Path(d) / "r.sqlite", ReplayConfig(capacity=capacity, min_reward=0.5)) as buf,
        ):
            for i, ok in before:
                buf.add(traj(i, success=ok, version=1))
            mark, want = buf.mark(), _state(buf)
            for i, ok in after:
                buf.add(traj(i, success=ok, version=9))
            buf.rollback(mark)
            assert _state(buf) == want
            for i, ok in again:
                buf.add(traj(i, success=ok, version=9))
            buf.rollback(mark)
            assert _state(buf) == want
            buf.rollback(None)
            assert len(buf) == 0 and buf.stats().rejections == {}

    check()


def test_rollback_survives_reopening_and_forget_evicted_bounds_the_copies(path):
    cfg = ReplayConfig(capacity=3)
    with ReplayBuffer(path, cfg) as buf:
        for i in range(3):
            buf.add(traj(i, version=0))
        mark = buf.mark()
        for i in range(3, 8):
            buf.add(traj(i, version=5))  # evicts every marked entry
        assert buf.ids() == ["t-5", "t-6", "t-7"]
    with ReplayBuffer(path, cfg) as buf:  # a new process after a kill
        assert buf.rollback(mark) == 3
        assert buf.ids() == ["t-0", "t-1", "t-2"] and {t.policy_version for t in buf.trajectories()} == {0}
        for i in range(3, 8):
            buf.add(traj(i, version=5))
        later = buf.mark()
        assert buf.forget_evicted(later["high_water"]) == 5
        buf.rollback(later)
        assert buf.ids() == ["t-5", "t-6", "t-7"]


def test_a_garbage_or_foreign_database_is_refused_with_the_file_named(tmp_path):
    import sqlite3

    from mentorrl.replay import ReplayBufferError

    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"\x00not a database at all" * 200)
    with pytest.raises(ReplayBufferError, match="garbage.sqlite"):
        ReplayBuffer(garbage)
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE users (name TEXT)")
    with pytest.raises(ReplayBufferError, match="other.sqlite.*not a replay buffer"):
        ReplayBuffer(other)
    assert {r[0] for r in sqlite3.connect(other).execute("SELECT name FROM sqlite_master")} == {"users"}  # untouched
    shaped = tmp_path / "shaped.sqlite"
    with sqlite3.connect(shaped) as conn:
        conn.execute("CREATE TABLE entries (seq INTEGER PRIMARY KEY, json TEXT)")
    with pytest.raises(ReplayBufferError, match="shaped.sqlite.*columns"):
        ReplayBuffer(shaped)
    truncated = tmp_path / "truncated.sqlite"
    with ReplayBuffer(truncated) as buf:
        for i in range(200):
            buf.add(traj(i, policy_tokens=50))
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 3])
    with pytest.raises(ReplayBufferError, match="truncated.sqlite"):
        with ReplayBuffer(truncated) as buf:
            buf.trajectories()


def test_rollback_refuses_another_buffer_or_an_older_copy(tmp_path):
    import shutil

    from mentorrl.replay import ReplayBufferError

    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    with ReplayBuffer(a) as buf:
        buf.add(traj(0))
    shutil.copy(a, tmp_path / "a-old.sqlite")
    with ReplayBuffer(a) as buf:
        buf.add(traj(1))
        mark = buf.mark()
    with ReplayBuffer(b) as other, pytest.raises(ReplayBufferError, match="b.sqlite.*replaced"):
        other.rollback(mark)
    with (
        ReplayBuffer(tmp_path / "a-old.sqlite") as old,
        pytest.raises(ReplayBufferError, match="a-old.sqlite.*older copy"),
    ):
        old.rollback(mark)

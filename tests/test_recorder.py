"""The recorder of external episodes: a faithful client's prompts extend the record, any other history
(edited, truncated, re-templated) is detected by token prefix, counted and starts a new segment, never
mixed; rewards and bounds; the agent launcher's per-episode outcomes."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mentorrl.rollout.recorder import Recorder, RecordError, divergence_kind, extension
from mentorrl.train.agents import AgentJob, outcome_counts, run_agents

CLOSE, EOS = 2, 3
STOPS = [CLOSE, EOS]


def recorder(tmp_path, **kw) -> Recorder:
    decode = kw.pop("decode", lambda ids: "".join(chr(97 + i % 26) for i in ids))
    return Recorder(tmp_path / "rec.sqlite", close_id=CLOSE, stop_ids=STOPS, decode=decode, **kw)


def test_a_faithful_conversation_is_one_segment(tmp_path):
    rec = recorder(tmp_path)
    rec.open_episode("e1", "t1")
    p1, c1 = [10, 11, 12], [20, 21, CLOSE]
    assert rec.record_completion("e1", "t1", p1, c1, [-0.1, -0.2, -0.3], 0) == {"segment": 0, "diverged": None}
    obs = [5, 13, 14, 5]  # the newline after the stop token, the tool turn, the next assistant header
    p2, c2 = p1 + c1 + obs, [22, CLOSE]
    assert rec.record_completion("e1", None, p2, c2, [-0.4, -0.5], 0)["diverged"] is None
    ep = rec.episode("e1")
    assert len(ep.segments) == 1
    seg = ep.segments[0]
    assert seg.token_ids == p2 + c2
    assert seg.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert seg.logprobs == [0, 0, 0, -0.1, -0.2, -0.3, 0, 0, 0, 0, -0.4, -0.5]
    assert seg.spans() == [("prompt", 0, 3), ("policy", 3, 6), ("observation", 6, 10), ("policy", 10, 12)]
    assert seg.versions == [0, 0] and seg.turns == 2
    assert rec.counters()["completions"] == 2 and rec.counters()["diverged_edited"] == 0


@pytest.mark.parametrize(
    "second, kind",
    [
        ([10, 99, 12, 20, 21, CLOSE, 5], "edited"),  # a message edited
        ([10, 11], "truncated"),  # history cut short
        ([10, 11, 12, 20, 7, CLOSE, 5], "edited"),  # the policy's own turn rewritten
    ],
)
def test_a_diverged_history_starts_a_new_segment_and_is_counted(tmp_path, second, kind):
    rec = recorder(tmp_path)
    rec.open_episode("e", "t")
    rec.record_completion("e", "t", [10, 11, 12], [20, 21, CLOSE], [-1.0] * 3, 0)
    out = rec.record_completion("e", "t", second, [30, CLOSE], [-2.0, -3.0], 0)
    assert out == {"segment": 1, "diverged": kind}
    segs = rec.episode("e").segments
    assert [s.token_ids for s in segs] == [[10, 11, 12, 20, 21, CLOSE], second + [30, CLOSE]]
    assert segs[1].loss_mask == [0] * len(second) + [1, 1]  # nothing of the first segment leaks in
    assert rec.counters()[f"diverged_{kind}"] == 1


def test_retemplated_history_is_told_from_an_edit(tmp_path):
    """Same text, other tokens (a client that re-renders the policy's turn differently)."""
    text = {10: "ab", 11: "a", 12: "b", 20: "c", 2: "|"}
    rec = recorder(tmp_path, decode=lambda ids: "".join(text.get(i, "?") for i in ids))
    rec.open_episode("e", "t")
    rec.record_completion("e", "t", [10], [20, CLOSE], [-1.0, -1.0], 0)
    out = rec.record_completion("e", "t", [11, 12, 20, CLOSE, 5], [20, CLOSE], [-1.0, -1.0], 0)
    assert out["diverged"] == "retokenized"


def test_the_template_may_close_a_turn_the_policy_did_not(tmp_path):
    """A turn that ended at the budget (no stop token) or on eos: the template's closing token stands in
    (loss mask 0), the eos the policy sampled is not kept (the next turn never saw it)."""
    rec = recorder(tmp_path)
    rec.open_episode("a", "t")
    rec.record_completion("a", "t", [10], [20, 21], [-1.0, -1.0], 0)  # cut at the budget
    assert rec.record_completion("a", "t", [10, 20, 21, CLOSE, 5], [22, CLOSE], [-1.0, -1.0], 0)["diverged"] is None
    seg = rec.episode("a").segments[0]
    assert seg.token_ids == [10, 20, 21, CLOSE, 5, 22, CLOSE] and seg.loss_mask == [0, 1, 1, 0, 0, 1, 1]
    rec.open_episode("b", "t")
    rec.record_completion("b", "t", [10], [20, EOS], [-1.0, -0.5], 0)
    assert rec.record_completion("b", "t", [10, 20, CLOSE, 5], [22, CLOSE], [-1.0, -1.0], 0)["diverged"] is None
    seg = rec.episode("b").segments[0]
    assert seg.token_ids == [10, 20, CLOSE, 5, 22, CLOSE] and seg.loss_mask == [0, 1, 0, 0, 1, 1]
    assert seg.logprobs == [0, -1.0, 0, 0, -1.0, -1.0]
    assert rec.counters()["closing_token_replaced"] == 1  # only the eos was replaced; the first was an extension


@settings(max_examples=200, deadline=None)
@given(
    tip=st.lists(st.integers(0, 6), min_size=1, max_size=8),
    prompt=st.lists(st.integers(0, 6), max_size=12),
)
def test_an_extension_never_changes_what_the_policy_wrote(tip, prompt):
    """Whatever the prompt, an accepted extension keeps every token of the record except at most a
    trailing stop token replaced by the closing token; anything else is rejected."""
    ext = extension(tip, prompt, CLOSE, STOPS)
    if ext is None:
        return
    new, replaced = ext
    kept = tip if not replaced or tip[-1] not in (EOS,) else tip[:-1]
    assert prompt == kept + new
    if replaced:
        assert new[0] == CLOSE


def test_divergence_kinds():
    assert divergence_kind([1, 2, 3], [1, 2], None) == "truncated"
    assert divergence_kind([1, 2, 3], [1, 9, 3, 4], None) == "edited"


def test_bounds_and_refusals(tmp_path):
    rec = recorder(tmp_path, max_completions=2, max_tokens=12, max_episodes=2)
    with pytest.raises(RecordError) as e:
        rec.record_completion("nobody", "t", [1], [2], [-1.0], 0)
    assert e.value.status == 404  # a stage's recorder only accepts the episodes it opened
    rec.open_episode("e", "t")
    with pytest.raises(RecordError, match="belongs to task"):
        rec.record_completion("e", "other", [1], [2], [-1.0], 0)
    rec.record_completion("e", "t", [1], [4, CLOSE], [-1.0, -1.0], 0)
    with pytest.raises(RecordError, match="tokens"):
        rec.record_completion("e", "t", [1, 4, CLOSE] + [5] * 20, [4], [-1.0], 0)
    rec.record_completion("e", "t", [1, 4, CLOSE, 5], [6, CLOSE], [-1.0, -1.0], 0)
    with pytest.raises(RecordError, match="completions"):
        rec.record_completion("e", "t", [1, 4, CLOSE, 5, 6, CLOSE], [6], [-1.0], 0)
    rec.open_episode("f", "t")
    with pytest.raises(RecordError) as e:
        rec.open_episode("g", "t")
    assert e.value.status == 507
    with pytest.raises(RecordError):
        rec.open_episode("bad id; DROP TABLE episodes", "t")
    rec.close_episodes(["e"])
    with pytest.raises(RecordError) as e:
        rec.record_completion("e", "t", [1], [2], [-1.0], 0)
    assert e.value.status == 409
    assert rec.counters()["refused"] == 5


def test_rewards(tmp_path):
    rec = recorder(tmp_path)
    rec.open_episode("e", "t")
    rec.set_reward("e", 0.5, {"success": False})
    rec.set_reward("e", 1.0, {"success": True})  # a later reward replaces an earlier one
    assert rec.rewards(["e", "x"]) == {"e": 1.0}
    assert rec.episode("e").details == {"success": True}
    for bad in (float("nan"), float("inf"), True, "1"):
        with pytest.raises(RecordError):
            rec.set_reward("e", bad)
    with pytest.raises(RecordError, match="details"):
        rec.set_reward("e", 1.0, {"blob": "x" * 20_000})
    rec.close_episodes(["e"])
    with pytest.raises(RecordError):
        rec.set_reward("e", 0.0)


def test_auto_open_for_a_standalone_server(tmp_path):
    rec = recorder(tmp_path, auto_open=True)
    rec.record_completion("new", "t", [1], [2], [-1.0], 3)
    assert rec.episode("new").task_id == "t" and rec.episode("new").segments[0].versions == [3]
    rec.record_completion("untagged", None, [1], [2], [-1.0], 0)
    assert rec.episode("untagged").task_id == "untagged"  # no task header: the episode is its own task
    with pytest.raises(RecordError):  # a reward never opens an episode
        rec.set_reward("never-asked", 1.0)
    assert rec.episode("never-asked") is None


def test_agent_outcomes_are_counted_per_episode(tmp_path):
    """Exit 0, a non-zero exit, a crash (a signal), a timeout: each is an outcome, none raises."""
    script = tmp_path / "agent.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "mode = os.environ['MODE']\n"
        "if mode == 'fail': sys.exit(3)\n"
        "if mode == 'crash': os.kill(os.getpid(), signal.SIGKILL)\n"
        "if mode == 'hang': time.sleep(60)\n"
        "sys.stderr.write('fine')\n"
    )
    jobs = [AgentJob(m, {"MODE": m}) for m in ("ok", "fail", "crash", "hang")]
    outs = run_agents([sys.executable, str(script)], jobs, concurrency=4, timeout_s=3.0)
    assert [o.status for o in outs] == ["ok", "nonzero", "crashed", "timeout"]
    assert outs[1].returncode == 3 and outs[2].returncode < 0 and outs[3].wall_s < 30
    assert outcome_counts(outs)["agent_timeout"] == 1.0
    missing = run_agents(["/nonexistent/agent"], [AgentJob("x", {})], 1, 1.0)
    assert missing[0].status == "launch_error"


def test_rewards_from_a_jsonl_file_and_the_wait(tmp_path):
    """A harness may append rewards to a file: whole lines only, read on from where the last read
    stopped; a bad line or a closed episode's is counted. The wait ends when every reward is in, or at
    the reward timeout after each agent's exit."""
    import json
    import time

    from mentorrl.train.agents import AgentOutcome
    from mentorrl.train.recipes.external import RewardFile, wait_for_rewards

    rec = recorder(tmp_path)
    for e in ("a", "b", "c"):
        rec.open_episode(e, "t")
    rec.close_episodes(["c"])
    path = tmp_path / "rewards.jsonl"
    path.write_text(
        json.dumps({"episode_id": "a", "reward": 1.0})
        + "\nnot json\n"
        + json.dumps({"episode_id": "c", "reward": 1})
        + "\n"
        + '{"episode_id": "b", "rew'
    )
    rf = RewardFile(str(path), rec)
    rf.poll()
    assert rec.rewards(["a", "b"]) == {"a": 1.0} and rf.bad == 2
    with open(path, "a") as f:
        f.write('ard": 0.5, "details": {"success": false}}\n')
    now = time.monotonic()
    outs = [AgentOutcome(e, "ok", 0, 1.0, now) for e in ("a", "b")] + [AgentOutcome("x", "timeout", None, 1.0, now)]
    assert wait_for_rewards(rec, outs, 5.0, rf.poll) == {"a": 1.0, "b": 0.5}  # the timed-out agent is not waited for
    rec.open_episode("d", "t")
    t0 = time.monotonic()
    assert wait_for_rewards(rec, [AgentOutcome("d", "ok", 0, 1.0, time.monotonic())], 0.3) == {}
    assert 0.25 < time.monotonic() - t0 < 5

"""The LLM judge against a small local HTTP server that answers scripted replies: a rubric as JSON,
malformed replies (counted, skipped, never invented), the prompt it sends (transcript, no answer key),
the response cache, the hybrid verifier/judge path and ``make_judge("llm")`` from the environment."""

from __future__ import annotations

import json

import pytest
from cli_helpers import cli_output, cli_with
from typer.testing import CliRunner

from mentorrl.cli.eval import register
from mentorrl.clients.config import ClientConfig
from mentorrl.clients.openai_api import TeacherClient
from mentorrl.envs.base import Task
from mentorrl.eval.agent import judge_agreement
from mentorrl.eval.judge import Judge, attach_judgements, judge_names, make_judge
from mentorrl.eval.llm_judge import (
    DIMENSIONS,
    LLMJudge,
    Rubric,
    hybrid_review_queue,
    hybrid_verdict,
    judge_client_config,
    rubric_messages,
    transcript,
)
from mentorrl.trajectory import JudgeVerdict, RewardBreakdown, ToolCall, Trajectory, read_jsonl, write_jsonl

RUBRIC = {
    "task_success": 0.9,
    "tool_correctness": 0.8,
    "state_tracking": 0.7,
    "efficiency": 0.6,
    "final_answer": 0.85,
    "safety": 1.0,
    "reason": "the refund was issued and reported",
}


def reply(content: str) -> str:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})


def make_client(url: str, route: str, **kw) -> TeacherClient:
    cfg = ClientConfig(
        base_url=f"{url}/{route}/v1", model="judge", timeout_s=2.0, max_retries=1, backoff_s=0.0, api_key_env=None, **kw
    )
    return TeacherClient(cfg, sleep=lambda s: None)


TASK = Task(
    id="t1",
    family="refund",
    split="heldout",
    prompt="Refund order A-1001 for jane@example.com.",
    seed=3,
    reference={"order_id": "SECRET-REF-9917", "amount": 42.5},
)


def make_traj(
    tid: str = "r1",
    success: bool | None = True,
    answer: str | None = "Refunded $42.50 on order A-1001.",
    judge_p: float | None = None,
) -> Trajectory:
    calls = [
        ToolCall(
            turn=1,
            name="get_order",
            arguments={"order_id": "A-1001"},
            raw='{"order_id": "A-1001"}',
            result={"order_id": "A-1001", "total": 42.5, "status": "delivered"},
        ),
        ToolCall(
            turn=2,
            name="refund_order",
            arguments={"order_id": "A-100"},
            raw='{"order_id": "A-100"}',
            error="no order A-100",
            error_kind="tool_exception",
        ),
        ToolCall(
            turn=3,
            name="refund_order",
            arguments={"order_id": "A-1001"},
            raw='{"order_id": "A-1001"}',
            result={"refunded": 42.5},
        ),
    ]
    return Trajectory(
        id=tid,
        task_id="t1",
        family="refund",
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.25],
        env_name="orders",
        env_version="1",
        tool_calls=calls,
        final_answer=answer,
        num_turns=4,
        reward=None if success is None else RewardBreakdown(success=success, total=0.8765, task=float(success)),
        judge=None if judge_p is None else JudgeVerdict(judge="test", success_prob=judge_p),
    )


# ------------------------------------------------------------ rubric and prompt ------
def test_a_valid_rubric_reply_gives_a_verdict(server):
    script, url = server
    script.plans["ok"] = [(200, reply(json.dumps(RUBRIC)))]
    judge = LLMJudge(make_client(url, "ok"))
    assert isinstance(judge, Judge)
    v = judge.judge(TASK, make_traj())
    assert v is not None and v.judge == "llm"
    assert v.success_prob == pytest.approx(0.9)  # success_prob = task_success
    assert v.scores == {k: RUBRIC[k] for k in DIMENSIONS}
    assert v.reason == RUBRIC["reason"]
    assert judge.stats["calls"] == 1 and judge.stats["verdicts"] == 1 and judge.stats["skipped"] == 0
    assert script.requests[-1]["temperature"] == 0.0 and script.requests[-1]["model"] == "judge"
    raw = judge.score(TASK, make_traj())
    assert raw == Rubric(**RUBRIC)
    m = judge.metrics()
    assert m["judge_calls"] == 2 and m["judge_verdicts"] == 2 and m["requests"] == 2


def test_weights_combine_rubric_scores_and_are_validated(server):
    script, url = server
    script.plans["w"] = [(200, reply(json.dumps(RUBRIC)))]
    judge = LLMJudge(make_client(url, "w"), name="llm-w", weights={"task_success": 1.0, "final_answer": 1.0})
    v = judge.judge(TASK, make_traj())
    assert v is not None and v.judge == "llm-w" and v.success_prob == pytest.approx((0.9 + 0.85) / 2)
    with pytest.raises(ValueError, match="unknown rubric"):
        LLMJudge(make_client(url, "w"), weights={"vibes": 1.0})
    with pytest.raises(ValueError, match="positive sum"):
        LLMJudge(make_client(url, "w"), weights={"task_success": 0.0})


def test_the_prompt_carries_the_transcript_and_not_the_answer_key_or_the_reward(server):
    script, url = server
    script.plans["p"] = [(200, reply(json.dumps(RUBRIC)))]
    LLMJudge(make_client(url, "p")).judge(TASK, make_traj())
    messages = script.requests[-1]["messages"]
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "JSON" in messages[0]["content"] and all(k in messages[0]["content"] for k in DIMENSIONS)
    sent = json.dumps(messages)
    user = messages[1]["content"]
    assert TASK.prompt in user
    for piece in (
        "get_order",
        "refund_order",
        '"order_id": "A-1001"',
        "no order A-100",
        "Refunded $42.50 on order A-1001.",
        '"refunded": 42.5',
        "Finish reason: answer",
    ):
        assert piece in user, piece
    assert user.index("get_order") < user.index("no order A-100") < user.index('"refunded": 42.5')
    for hidden in ("SECRET-REF-9917", "0.8765", "reference", "reward", "loss_mask", "logprob"):
        assert hidden not in sent, hidden
    # deterministic (the cache keys on it), and without a task only the trajectory is shown
    assert rubric_messages(TASK, make_traj()) == messages
    blind = transcript(None, make_traj())
    assert "(not recorded)" in blind and TASK.prompt not in blind and "refund_order" in blind


def test_transcript_shows_unparsable_calls_missing_answers_and_clips_long_returns():
    t = make_traj(answer=None).model_copy(update={"finish_reason": "max_turns"})
    t.tool_calls.append(
        ToolCall(turn=4, name=None, arguments=None, raw="<garbage", error="could not parse", error_kind="malformed")
    )
    t.tool_calls[0] = t.tool_calls[0].model_copy(update={"result": "x" * 5000})
    text = transcript(TASK, t, max_chars=100)
    assert "unparsable call: <garbage" in text and "error (malformed): could not parse" in text
    assert "## Final answer\n(none)" in text and "Finish reason: max_turns" in text
    assert "x" * 100 + " ...[4900 more chars]" in text and "x" * 101 not in text


# ------------------------------------------------------------ bad replies ------
@pytest.mark.parametrize(
    "content",
    [
        "The agent did well, I would say 0.9.",
        json.dumps({**RUBRIC, "task_success": 1.7}),
        json.dumps({k: v for k, v in RUBRIC.items() if k != "state_tracking"}),
        json.dumps({**RUBRIC, "efficiency": "0.6"}),
        json.dumps(RUBRIC)[:-10],
    ],
    ids=["not-json", "score-1.7", "missing-field", "score-as-string", "truncated"],
)
def test_an_invalid_rubric_is_counted_and_gives_no_verdict(server, content):
    script, url = server
    script.plans["bad"] = [(200, reply(content))]
    judge = LLMJudge(make_client(url, "bad"))
    assert judge.judge(TASK, make_traj()) is None
    assert judge.stats["skipped"] == 1 and judge.stats["verdicts"] == 0
    assert judge.client.stats["invalid_structured"] == 1
    # attached: the trajectory stays unjudged and is left out of the agreement metrics
    trajs = attach_judgements(judge, [TASK], [make_traj("a"), make_traj("b")])
    assert all(t.judge is None for t in trajs) and judge_agreement(trajs) is None


def test_server_failures_and_malformed_responses_are_skipped_without_raising(server):
    script, url = server
    script.plans["down"] = [(500, "oops")]
    script.plans["junk"] = [(200, json.dumps({"choices": []}))]
    down, junk = LLMJudge(make_client(url, "down")), LLMJudge(make_client(url, "junk"))
    assert down.judge(TASK, make_traj()) is None and junk.judge(TASK, make_traj()) is None
    assert down.stats["skipped"] == 1 and down.client.stats["failures"] == 1 and script.hits["down"] == 2
    assert junk.stats["skipped"] == 1 and junk.client.stats["malformed"] == 1


def test_a_fenced_json_reply_is_accepted_and_extra_keys_ignored(server):
    script, url = server
    script.plans["fence"] = [(200, reply("```json\n" + json.dumps({**RUBRIC, "overall": 0.8}) + "\n```"))]
    judge = LLMJudge(make_client(url, "fence"))
    v = judge.judge(TASK, make_traj())
    assert v is not None and v.success_prob == pytest.approx(0.9) and "overall" not in v.scores
    assert judge.stats["verdicts"] == 1 and judge.client.stats["invalid_structured"] == 0


def test_safety_defaults_to_one_when_omitted(server):
    script, url = server
    script.plans["s"] = [(200, reply(json.dumps({k: v for k, v in RUBRIC.items() if k != "safety"})))]
    v = LLMJudge(make_client(url, "s")).judge(TASK, make_traj())
    assert v is not None and v.scores["safety"] == 1.0


# ------------------------------------------------------------ caching ------
def test_judging_twice_with_a_cache_makes_one_request(server, tmp_path):
    script, url = server
    script.plans["c"] = [(200, reply(json.dumps(RUBRIC)))]
    cache = str(tmp_path / "judge.sqlite")
    judge = LLMJudge(make_client(url, "c", cache_path=cache))
    first, second = judge.judge(TASK, make_traj()), judge.judge(TASK, make_traj())
    assert first == second and first is not None
    assert script.hits["c"] == 1
    assert judge.client.stats["cache_hits"] == 1 and judge.client.stats["requests"] == 1
    assert judge.stats["calls"] == 2 and judge.stats["verdicts"] == 2
    # a fresh client on the same cache file (a new process) does not ask again
    again = LLMJudge(make_client(url, "c", cache_path=cache))
    assert again.judge(TASK, make_traj()) == first and script.hits["c"] == 1
    # a different transcript is a different request
    judge.judge(TASK, make_traj(answer="Done."))
    assert script.hits["c"] == 2


# ------------------------------------------------------------ hybrid verification ------
def verdict(p: float) -> JudgeVerdict:
    return JudgeVerdict(judge="llm", success_prob=p)


def test_hybrid_the_verifier_decides_and_disagreements_go_to_review():
    h = hybrid_verdict(make_traj(success=True), verdict(0.1))
    assert h.success is True and h.decided_by == "verifier" and h.needs_review and h.judge_success is False
    assert "verifier says success" in h.reason and "judge says failure" in h.reason
    h = hybrid_verdict(make_traj(success=False), verdict(0.8))
    assert h.success is False and h.needs_review and h.judge_success is True
    for ok, p in ((True, 0.9), (False, 0.2)):  # agreement
        h = hybrid_verdict(make_traj(success=ok), verdict(p))
        assert h.success is ok and not h.needs_review
    h = hybrid_verdict(make_traj(success=True), None)  # judge unavailable, verifier present
    assert h.success is True and not h.needs_review and h.judge_success is None


def test_hybrid_without_a_verifier_the_judge_decides():
    h = hybrid_verdict(make_traj(success=None), verdict(0.7))
    assert h.verifier_success is None and h.success is True and h.decided_by == "judge" and not h.needs_review
    h = hybrid_verdict(make_traj(success=None), verdict(0.7), threshold=0.75)
    assert h.success is False
    h = hybrid_verdict(make_traj(success=None), None)  # the only signal is missing
    assert h.success is None and h.decided_by == "none" and h.needs_review


def test_review_queue_orders_disagreements_by_judge_confidence():
    trajs = [
        make_traj("agree", success=True, judge_p=0.9),
        make_traj("mild", success=True, judge_p=0.4),  # judge says failure with confidence 0.6
        make_traj("none", success=None),  # no signal at all
        make_traj("strong", success=False, judge_p=0.97),  # judge says success with confidence 0.97
        make_traj("judge-only", success=None, judge_p=0.2),
        make_traj("medium", success=True, judge_p=0.2),  # judge says failure with confidence 0.8
    ]
    queue = hybrid_review_queue(trajs)
    assert [h.trajectory_id for h in queue] == ["strong", "medium", "mild", "none"]
    assert queue[0].judge_confidence == pytest.approx(0.97) and queue[0].success is False
    # explicit verdicts (aligned with the trajectories) take the place of the recorded ones
    explicit = hybrid_review_queue(trajs[:2], [verdict(0.1), verdict(0.95)])
    assert [h.trajectory_id for h in explicit] == ["agree"]
    with pytest.raises(ValueError, match="2 verdicts for 1"):
        hybrid_review_queue(trajs[:1], [None, None])


def test_judge_then_hybrid_end_to_end(server):
    script, url = server
    fail = {**RUBRIC, "task_success": 0.05, "reason": "the refund tool call failed first"}
    script.plans["e2e"] = [(200, reply(json.dumps(RUBRIC))), (200, reply(json.dumps(fail))), (200, reply("nope"))]
    judge = LLMJudge(make_client(url, "e2e"))
    trajs = attach_judgements(
        judge, {"t1": TASK}, [make_traj("a", success=False), make_traj("b", success=True), make_traj("c", success=None)]
    )
    queue = hybrid_review_queue(trajs)
    assert [h.trajectory_id for h in queue] == ["b", "a", "c"]  # 0.95 > 0.9 confidence; then no signal
    assert [h.success for h in queue] == [True, False, None]  # the verifier's word stands
    assert judge.metrics()["judge_skipped"] == 1


# ------------------------------------------------------------ make_judge("llm") ------
def test_make_judge_llm_from_environment_without_network_at_construction(server, monkeypatch, tmp_path):
    script, url = server
    script.plans["env"] = [(200, reply(json.dumps(RUBRIC)))]
    monkeypatch.setenv("MENTORRL_JUDGE_BASE_URL", f"{url}/env/v1")
    monkeypatch.setenv("MENTORRL_JUDGE_MODEL", "judge-model")
    monkeypatch.setenv("MENTORRL_JUDGE_API_KEY_ENV", "MENTORRL_TEST_JUDGE_KEY")
    monkeypatch.setenv("MENTORRL_TEST_JUDGE_KEY", "sk-judge-secret")
    monkeypatch.setenv("MENTORRL_JUDGE_CACHE", str(tmp_path / "cache.sqlite"))
    assert "llm" in judge_names()
    judge = make_judge("llm")
    assert isinstance(judge, LLMJudge) and judge.name == "llm" and script.requests == []
    assert "sk-judge-secret" not in repr(judge)
    cfg = judge.client.config
    assert cfg.model == "judge-model" and cfg.api_key_env == "MENTORRL_TEST_JUDGE_KEY"
    assert cfg.cache_path == str(tmp_path / "cache.sqlite")
    v = judge.judge(TASK, make_traj())
    assert v is not None and v.success_prob == pytest.approx(0.9) and script.hits["env"] == 1
    assert script.requests[-1]["model"] == "judge-model"


def test_judge_client_config_defaults_and_missing_variables(tmp_path):
    env = {
        "MENTORRL_JUDGE_BASE_URL": "http://127.0.0.1:9/v1",
        "MENTORRL_JUDGE_MODEL": "m",
        "XDG_CACHE_HOME": str(tmp_path),
    }
    cfg = judge_client_config(env)
    assert cfg.api_key_env == "OPENAI_API_KEY" and cfg.cache_path == str(tmp_path / "mentorrl" / "llm_judge.sqlite")
    cfg = judge_client_config(
        {**env, "MENTORRL_JUDGE_API_KEY_ENV": "none", "MENTORRL_JUDGE_CACHE": "none", "MENTORRL_JUDGE_TIMEOUT_S": "90"}
    )
    assert cfg.api_key_env is None and cfg.cache_path is None and cfg.timeout_s == 90.0
    with pytest.raises(ValueError, match="MENTORRL_JUDGE_MODEL"):
        judge_client_config({"MENTORRL_JUDGE_BASE_URL": "http://127.0.0.1:9/v1"})


def test_eval_cli_with_the_llm_judge_on_recorded_trajectories(server, monkeypatch, tmp_path, tiny_model_dir):
    script, url = server
    fail = {**RUBRIC, "task_success": 0.1}
    script.plans["cli"] = [(200, reply(json.dumps(RUBRIC))), (200, reply("not json")), (200, reply(json.dumps(fail)))]
    prod = tmp_path / "prod.jsonl"
    write_jsonl(prod, [make_traj("a", success=True), make_traj("b", success=False), make_traj("c", success=True)])
    args = ["eval", str(tiny_model_dir), "--on", f"production:{prod}", "--judge", "llm", "--out", str(tmp_path / "out")]
    monkeypatch.delenv("MENTORRL_JUDGE_BASE_URL", raising=False)
    res = CliRunner().invoke(cli_with(register), args)
    assert res.exit_code == 2 and "MENTORRL_JUDGE_BASE_URL" in cli_output(res)
    monkeypatch.setenv("MENTORRL_JUDGE_BASE_URL", f"{url}/cli/v1")
    monkeypatch.setenv("MENTORRL_JUDGE_MODEL", "judge-model")
    monkeypatch.setenv("MENTORRL_JUDGE_CACHE", "none")
    res = CliRunner().invoke(cli_with(register), args)
    assert res.exit_code == 0, cli_output(res)
    assert "no verdict for 1 of 3 trajectories" in res.output
    summary = json.loads((tmp_path / "out" / "eval_summary.json").read_text())
    stats = summary["judge_stats"]
    assert stats["judge_calls"] == 3 and stats["judge_verdicts"] == 2 and stats["judge_skipped"] == 1
    assert stats["invalid_structured"] == 1 and script.hits["cli"] == 3
    agreement = summary["sets"]["production:prod"]["metrics"]["overall"]["judge"]
    assert agreement["n"] == 2 and agreement["agreement"] == 0.5  # a agrees, c does not, b unjudged
    trajs = {t.id: t for t in read_jsonl(tmp_path / "out" / summary["sets"]["production:prod"]["trajectories"])}
    assert trajs["b"].judge is None and trajs["a"].judge.judge == "llm"

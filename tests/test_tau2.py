"""The τ²-bench adapter (mentorrl/envs/tau2/) against the team's toy clone (tests/fixtures/tau2_clone/):
the schemas, the expert's full reward, the audit attacks that win and the tasks they are flagged on,
NL assertions refused without a judge, the config checks before the first step, and a hostile child
process bounded. ``TAU2_CLONE`` (a real clone; ``TAU2_DOMAIN``, default retail) adds a check on it."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import get_args

import pytest

from mentorrl.config.base import ConfigError
from mentorrl.config.env import EnvConfig
from mentorrl.envs import resolve_env
from mentorrl.envs.base import FinalAnswer, Task, ToolAction
from mentorrl.envs.tau2 import Tau2Env, tau2_attacks
from mentorrl.envs.tau2 import protocol as proto
from mentorrl.envs.tau2.audit import benchmark_reward, play
from mentorrl.envs.tau2.child import Domain
from mentorrl.envs.tau2.env import MAX_OBSERVATION_CHARS, USER_TOOL
from mentorrl.envs.tau2.records import TASK_SETS, Tau2Task, check_clone
from mentorrl.envs.tau2.reward import JudgeReply, communicate_checks, score
from mentorrl.envs.tau2.users import ENDED, STOP, ScriptedUser

FIXTURE = Path(__file__).parent / "fixtures" / "tau2_clone"
DATA = FIXTURE / "data" / "tau2" / "domains" / "toy"
TASKS = {t["id"]: t for t in json.loads((DATA / "tasks.json").read_text())}
SPLITS = json.loads((DATA / "split_tasks.json").read_text())


def env_cfg(path=FIXTURE, **kw) -> EnvConfig:
    return EnvConfig(name="tau2", path=str(path), domain=kw.pop("domain", "toy"), python=sys.executable, **kw)


@pytest.fixture(scope="module")
def entry():
    return resolve_env(env_cfg())


@pytest.fixture(scope="module")
def source(entry):
    return entry.make_tasks()


def task_of(tid: str) -> Task:
    rec = Tau2Task.model_validate(TASKS[tid])
    return Task(
        id=f"t-{tid}",
        family="toy",
        split="train",
        prompt="",
        seed=0,
        reference={"tau2": rec.model_dump(mode="json"), "tau2_id": tid},
    )


def copy_clone(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    shutil.copytree(FIXTURE, clone, ignore=shutil.ignore_patterns("__pycache__"))
    return clone


# ------------------------------------------------------------------ schemas ----
def test_the_tools_are_the_toolkits_schemas_plus_the_user_channel(entry):
    env = entry.make_env()
    try:
        specs = {s["function"]["name"]: s["function"] for s in env.registry.specs()}
        # every decorated toolkit method is a tool, the undecorated helper is not
        assert set(specs) == {
            "get_user_details",
            "get_order_details",
            "cancel_pending_order",
            "transfer_to_human_agents",
            USER_TOOL,
        }
        cancel = specs["cancel_pending_order"]["parameters"]
        assert cancel["required"] == ["order_id", "reason"] and cancel["properties"]["reason"]["type"] == "string"
        assert all(s["description"] for s in specs.values())
        assert entry.mutating_tools == ("cancel_pending_order",)  # the WRITE tool only
        assert (DATA / "policy.md").read_text().strip() in env.system_prompt
    finally:
        env.close()


def test_bad_arguments_never_reach_the_domain(entry):
    env = entry.make_env()
    try:
        env.reset(task_of("0"))
        assert env.step("cancel_pending_order", {"order_id": 1}).error_kind == "bad_arguments"
        assert env.step("no_such_tool", {}).error_kind == "unknown_tool"
        refused = env.step("cancel_pending_order", {"order_id": "#T1002", "reason": "no longer needed"})
        assert not refused.ok and "Non-pending" in refused.error  # the domain's own refusal, as an observation
    finally:
        env.close()


# ------------------------------------------------------------ expert, reward ----
def test_the_expert_earns_the_full_reward_on_every_task_it_can_be_scored_on(entry, source):
    env = entry.make_env()
    expert = entry.make_expert()
    try:
        for split in ("base", "train", "heldout"):
            for task in source.tasks(split, n=len(source.rows[split]), seed=0):
                verdict = play(env, task, expert.act)
                assert verdict.success and benchmark_reward(verdict) == 1.0, (
                    task.reference["tau2_id"],
                    verdict.details,
                )
                components = verdict.details["tau2"]["components"]
                assert set(components) == set(TASKS[task.reference["tau2_id"]]["evaluation_criteria"]["reward_basis"])
    finally:
        env.close()


def test_each_episode_starts_from_a_fresh_environment(entry):
    env = entry.make_env()
    try:
        env.reset(task_of("0"))
        assert env.step("cancel_pending_order", {"order_id": "#T1001", "reason": "no longer needed"}).ok
        env.reset(task_of("0"))  # the write above must not leak into this episode
        order = json.loads(env.step("get_order_details", {"order_id": "#T1001"}).content)
        assert order["status"] == "pending"
        env.reset(task_of("4"))  # the task's initial state is applied
        assert json.loads(env.step("get_order_details", {"order_id": "#T1003"}).content)["status"] == "pending"
    finally:
        env.close()


def test_a_wrong_write_or_a_missing_message_scores_zero(entry):
    env = entry.make_env()
    try:
        env.reset(task_of("0"))
        env.step("cancel_pending_order", {"order_id": "#T1001", "reason": "ordered by mistake"})  # wrong reason
        assert benchmark_reward(env.verify("Done.")) == 0.0
        env.reset(task_of("2"))
        env.step("get_order_details", {"order_id": "#T1003"})
        verdict = env.verify("I looked it up.")  # never says the status
        assert verdict.details["tau2"]["components"] == {"DB": 1.0, "COMMUNICATE": 0.0} and not verdict.success
    finally:
        env.close()


def test_communicate_is_a_case_insensitive_substring_of_an_agent_message():
    assert communicate_checks(["Shipped", "1,234"], ["it was SHIPPED today", "total 1234"]) == {
        "Shipped": True,
        "1,234": False,
    }
    assert communicate_checks(["1234"], ["total 1,234"]) == {"1234": True}  # commas leave the message


# -------------------------------------------------------------- NL assertions ----
class StubJudge:
    def __init__(self, reply):
        self.reply, self.calls = reply, 0

    def structured(self, messages, schema):
        self.calls += 1
        return self.reply

    def close(self):
        pass


def test_nl_assertion_tasks_are_refused_and_counted_without_a_judge(source):
    nl = {
        tid
        for tid, t in TASKS.items()
        if "NL_ASSERTION" in t["evaluation_criteria"]["reward_basis"] and t["evaluation_criteria"]["nl_assertions"]
    }
    assert nl and set(source.report["refused_nl_assertion_all_splits"]) == nl
    assert set(source.report["refused_nl_assertion"]) == nl & set(SPLITS["train"])
    for split, rows in source.rows.items():
        assert not {ref["tau2_id"] for _, ref in rows} & nl, split


def test_a_judge_decides_nl_assertions_and_an_empty_reply_fails():
    crit = Tau2Task.model_validate(TASKS["3"]).evaluation_criteria
    ev = {"ok": True, "db_match": True, "assertions": []}
    args = ("3", crit, ev, ["refund"], [], [("assistant", "refund")])
    assert score(*args, judge=StubJudge(JudgeReply(met=[True]))).reward == 1.0
    assert score(*args, judge=StubJudge(JudgeReply(met=[False]))).reward == 0.0
    assert score(*args, judge=StubJudge(None)).reward == 0.0  # upstream counts an empty reply as a pass
    assert score(*args, judge=StubJudge(JudgeReply(met=[]))).reward == 0.0
    assert score(*args, judge=None).reward == 0.0


def test_with_a_judge_configured_nl_tasks_stay(tmp_path):
    from mentorrl.envs.tau2.tasks import Tau2Tasks

    entry = resolve_env(env_cfg(judge={"base_url": "http://127.0.0.1:9/v1"}, split="base", exclude_hackable=False))
    src = entry.make_tasks()
    assert isinstance(src, Tau2Tasks) and src.report["refused_nl_assertion"] == []
    assert "3" in {ref["tau2_id"] for _, ref in src.rows["train"]}


def test_the_configured_judge_scores_an_nl_task_in_the_episode(monkeypatch):
    from mentorrl.envs.tau2 import env as tau2_env

    judge = StubJudge(JudgeReply(met=[True]))
    monkeypatch.setattr(tau2_env, "make_client", lambda cfg: None if cfg is None else judge)
    entry = resolve_env(env_cfg(judge={"base_url": "http://127.0.0.1:9/v1", "model": "j"}, exclude_hackable=False))
    env, expert = entry.make_env(), entry.make_expert()
    try:
        verdict = play(env, task_of("3"), expert.act)
        assert verdict.success and verdict.details["tau2"]["components"] == {"DB": 1.0, "NL_ASSERTION": 1.0}
        assert judge.calls == 1
        judge.reply = None  # an empty judge reply fails the task
        assert not play(env, task_of("3"), expert.act).success
        play(env, task_of("0"), expert.act)
        assert judge.calls == 2  # a task without NL assertions never asks the judge
    finally:
        env.close()


# --------------------------------------------------------------------- audit ----
def test_do_nothing_is_flagged_on_the_no_op_task_and_left_out_of_training(source):
    hackable = source.report["hackable"]
    # every attack changes nothing: it wins exactly where the gold actions change nothing, and nothing must be said
    assert "do_nothing" in hackable.get("1", [])
    assert set(hackable) == {"1"}
    assert "1" not in {ref["tau2_id"] for _, ref in source.rows["train"]}
    assert "1" in {ref["tau2_id"] for _, ref in source.rows["base"]}  # evaluation splits keep it
    heldout = {ref["tau2_id"] for _, ref in source.rows["heldout"]}
    assert heldout == set(SPLITS["test"]) - set(source.report["refused_nl_assertion_all_splits"])
    assert {ref["tau2_id"] for _, ref in source.rows["hidden"]} == heldout


def test_the_test_split_as_hidden_is_never_trained_on(source):
    from mentorrl.config.names import HiddenSetError
    from mentorrl.eval.sets import assert_trainable

    with pytest.raises(HiddenSetError):
        assert_trainable(source.tasks("hidden", n=2, seed=0))
    assert_trainable(source.tasks("train", n=2, seed=0))
    assert source.report["train_tasks"] == len(source.rows["train"])


def test_the_attacks_score_zero_where_the_task_needs_work(entry):
    env = entry.make_env()
    try:
        for tid in ("0", "2", "4"):
            for attack in tau2_attacks():
                assert benchmark_reward(play(env, task_of(tid), attack.script)) == 0.0, (tid, attack.name)
    finally:
        env.close()


def test_the_preflight_audit_passes_on_the_screened_pool_and_fails_without_the_screen(tmp_path, tokenizer):
    from mentorrl.config import load_config
    from mentorrl.train.pipeline import RewardAuditFailed, preflight_reward_audit
    from mentorrl.train.workspace import open_workspace

    base = [
        f"run_dir={tmp_path}",
        "threads=1",
        "env.name=tau2",
        f"env.path={FIXTURE}",
        "env.domain=toy",
        f"env.python={sys.executable}",
    ]
    ws = open_workspace(load_config(None, base), show_progress=False)
    ws.bind_tokenizer(tokenizer)
    report = preflight_reward_audit(ws)
    assert report is not None and report["passed"] and report["honest"]["failures"] == []
    assert {a["name"] for a in report["attacks"]} == {"do_nothing", "refuse", "transfer_at_once"}
    assert all(a["successes"] == [] for a in report["attacks"])  # no attack wins a task of the screened pool
    assert report["task_source"]["hackable"] == {"1": ["do_nothing", "refuse", "transfer_at_once"]}  # reported
    ws = open_workspace(
        load_config(None, [*base, f"run_dir={tmp_path / 'b'}", "env.exclude_hackable=false"]), show_progress=False
    )
    ws.bind_tokenizer(tokenizer)
    with pytest.raises(RewardAuditFailed, match="refusing to train"):
        preflight_reward_audit(ws)
    data = json.loads((tmp_path / "b" / "reward_audit.json").read_text())
    won = {a["name"]: a["successes"] for a in data["attacks"]}
    assert won["do_nothing"] and won["transfer_at_once"]  # the unscreened pool has the no-op task


# ---------------------------------------------------------------------- solo ----
def test_tasks_with_user_actions_are_left_out_outside_solo_mode(source):
    user_acts = {
        tid
        for tid, t in TASKS.items()
        if any(a.get("requestor") == "user" for a in t["evaluation_criteria"]["actions"])
    }
    assert user_acts and set(source.report["left_out_all_splits"]["user_actions"]) == user_acts
    assert not user_acts & {ref["tau2_id"] for rows in source.rows.values() for _, ref in rows}


def test_solo_mode_gives_the_ticket_and_the_users_tools_and_no_user():
    entry = resolve_env(env_cfg(solo=True, split="base"))
    source = entry.make_tasks()
    with_ticket = {tid for tid, t in TASKS.items() if t.get("ticket")}
    assert {ref["tau2_id"] for _, ref in source.rows["base"]} == with_ticket
    env, expert = entry.make_env(), entry.make_expert()
    try:
        names = {s["function"]["name"] for s in env.registry.specs()}
        assert {"check_parcel", "mark_parcel_received", "get_order_details"} <= names and USER_TOOL not in names
        assert "mark_parcel_received" in entry.mutating_tools
        for task in source.tasks("base", n=len(with_ticket), seed=0):
            tid = task.reference["tau2_id"]
            assert env.reset(task) == TASKS[tid]["ticket"]
            assert play(env, task, expert.act).success  # the expert takes the user's gold action too
            for attack in tau2_attacks():
                assert benchmark_reward(play(env, task, attack.script)) == 0.0, (tid, attack.name)
    finally:
        env.close()


def test_solo_mode_on_a_domain_without_it_is_a_config_error(tmp_path):
    clone = copy_clone(tmp_path)
    envpy = clone / "src" / "tau2" / "domains" / "toy" / "environment.py"
    envpy.write_text(
        envpy.read_text().replace(
            "    with open(TOY_POLICY_PATH) as f:",
            '    if solo_mode:\n        raise ValueError("Toy domain does not support solo mode")\n    with open(TOY_POLICY_PATH) as f:',
        )
    )
    with pytest.raises(ConfigError, match="env.solo.*does not support solo mode"):
        resolve_env(env_cfg(clone, solo=True))
    with pytest.raises(ValueError, match="solo: only for name: tau2"):
        EnvConfig(name="orders", solo=True)


# ----------------------------------------------------------------- task sets ----
def test_the_task_set_picks_the_task_file_and_its_splits(tmp_path):
    source = resolve_env(env_cfg(task_set="small", exclude_hackable=False)).make_tasks()
    ids = lambda split: {ref["tau2_id"] for _, ref in source.rows[split]}  # noqa: E731
    assert ids("train") == {"0"} and ids("test") == ids("heldout") == {"4"}  # split_tasks.json, kept to the set
    assert source.report["task_set"] == "small" and source.report["tasks_in_split"] == 1
    assert source.report["left_out_all_splits"]["in_no_split"] == ["s1"]  # in tasks_small.json, in no split
    clone = copy_clone(tmp_path)  # upstream's split_<task file> beside it wins over split_tasks.json
    (clone / "data" / "tau2" / "domains" / "toy" / "split_tasks_small.json").write_text('{"train": ["s1", "4"]}')
    source = resolve_env(env_cfg(clone, task_set="small", exclude_hackable=False)).make_tasks()
    assert {ref["tau2_id"] for _, ref in source.rows["train"]} == {"s1", "4"}
    assert source.report["left_out_all_splits"]["in_no_split"] == ["0"]


def test_a_task_set_off_the_allow_list_is_refused():
    for name in ("../tasks", "tasks_small.json", "/etc/passwd", "voice"):
        with pytest.raises(ValueError, match="task_set"):
            env_cfg(task_set=name)
    with pytest.raises(ValueError, match="task_set: only for name: tau2"):
        EnvConfig(name="orders", task_set="small")
    with pytest.raises(ConfigError, match="env.task_set.*'voice' is not one of"):
        check_clone(str(FIXTURE), "toy", "voice")
    assert get_args(EnvConfig.model_fields["task_set"].annotation) == tuple(TASK_SETS)


def test_a_missing_task_file_or_an_empty_split_is_a_config_error_before_the_first_step(tmp_path):
    with pytest.raises(ConfigError, match=r"env.task_set: .*toy/tasks_full.json.*task sets it has: tasks, small"):
        resolve_env(env_cfg(task_set="full"))
    clone = copy_clone(tmp_path)
    data = clone / "data" / "tau2" / "domains" / "toy"
    (data / "tasks_full.json").write_text(json.dumps([TASKS["4"]]))
    with pytest.raises(ConfigError, match="env.split: no task of toy/tasks_full.json.*'train'.*its tasks: test, base"):
        resolve_env(env_cfg(clone, task_set="full"))
    assert resolve_env(env_cfg(clone, task_set="full", split="test"))  # a split that lists it
    (data / "tasks.json").unlink()
    with pytest.raises(ConfigError, match="env.path: .*toy/tasks.json.*task sets it has: small, full"):
        resolve_env(env_cfg(clone))


def test_each_initialization_action_and_assertion_is_followed_by_a_sync():
    # upstream's run_env_function_call syncs after each call: telecom's device must see a suspended line
    log = []
    kit = type("Kit", (), {"act": lambda self, **kw: log.append(("act", kw)) or True})()
    env = type("Env", (), {"tools": kit, "user_tools": kit, "sync_tools": lambda self: log.append("sync")})()
    for env_type in ("assistant", "user"):
        assert Domain.function_call(env, {"env_type": env_type, "func_name": "act", "arguments": {"x": 1}})
    assert log == [("act", {"x": 1}), "sync", ("act", {"x": 1}), "sync"]


# ---------------------------------------------------------------------- users ----
def test_the_scripted_user_confirms_answers_and_ends():
    user = ScriptedUser(Tau2Task.model_validate(TASKS["0"]).user_scenario, max_turns=3)
    assert "#T1001" in user.opening() and "ada_lovelace_1815" in user.opening()
    assert user.reply("I will cancel #T1001. Do you confirm?").startswith("Yes")
    assert "ada_lovelace_1815" in user.reply("What is your user id?")
    assert STOP in user.reply("Your order is cancelled.")
    assert user.reply("Anything else?") == ENDED
    patient = ScriptedUser(Tau2Task.model_validate(TASKS["0"]).user_scenario, max_turns=2)
    replies = [patient.reply("Shall I go on?") for _ in range(4)]
    assert STOP in replies[2] and replies[3] == ENDED  # leaves after max_turns answers


def test_the_user_channel_is_a_tool_whose_answer_is_the_observation(entry):
    env = entry.make_env()
    try:
        env.reset(task_of("0"))
        assert env.step(USER_TOOL, {"message": "Do you confirm the cancellation?"}).content.startswith("Yes")
    finally:
        env.close()


class StubChat:
    """An OpenAI-compatible user model: scripted replies, and every conversation it was sent."""

    def __init__(self, replies):
        self.replies, self.seen = list(replies), []

    def chat(self, messages):
        self.seen.append([dict(m) for m in messages])
        return self.replies.pop(0) if self.replies else None

    def close(self):
        pass


def test_the_llm_user_is_opt_in_and_ends_on_stop(monkeypatch):
    from mentorrl.envs.tau2 import env as tau2_env

    stub = StubChat(["Hi, I want to cancel order #T1001.", "Yes, go ahead.", f"Thanks! {STOP}"])
    monkeypatch.setattr(tau2_env, "make_client", lambda cfg: None if cfg is None else stub)
    entry = resolve_env(env_cfg(user="llm", user_client={"base_url": "http://127.0.0.1:9/v1", "model": "u"}))
    env = entry.make_env()
    try:
        assert env.reset(task_of("0")) == "Hi, I want to cancel order #T1001."
        system = stub.seen[0][0]["content"]
        assert "#T1001" in system and "ada_lovelace_1815" in system  # the scenario, for the user model only
        assert env.step(USER_TOOL, {"message": "Cancel #T1001, do you confirm?"}).content == "Yes, go ahead."
        assert STOP in env.step(USER_TOOL, {"message": "Done."}).content
        assert env.step(USER_TOOL, {"message": "Anything else?"}).content == ENDED
        assert stub.seen[1][-1] == {"role": "user", "content": "Cancel #T1001, do you confirm?"}  # roles flipped
    finally:
        env.close()


def test_the_entry_pickles_for_remote_workers(entry):
    import pickle

    env = pickle.loads(pickle.dumps(entry.make_env))(tool_timeout_s=3.0)
    try:
        assert env.reset(task_of("1")) and env.step("get_order_details", {"order_id": "#T1002"}).ok
    finally:
        env.close()
    assert pickle.loads(pickle.dumps(entry.make_expert))().mutating == {"cancel_pending_order"}


# ---------------------------------------------------------------- config checks ----
def test_bad_paths_domains_and_files_are_config_errors_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="env.path"):
        resolve_env(env_cfg(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="env.path.*not a tau2-bench clone"):
        resolve_env(env_cfg(tmp_path))
    with pytest.raises(ConfigError, match="env.domain.*'nope'.*toy"):
        resolve_env(env_cfg(domain="nope"))
    with pytest.raises(ConfigError, match="env.split.*toy"):
        resolve_env(env_cfg(split="dev"))
    with pytest.raises(ConfigError, match="env.python"):
        resolve_env(EnvConfig(name="tau2", path=str(FIXTURE), domain="toy", python=str(tmp_path / "nopython")))
    with pytest.raises(ConfigError, match="env.path"):
        resolve_env(EnvConfig(name="tau2"))
    for name in ("tasks.json", "split_tasks.json", "policy.md", "db.json"):
        clone = copy_clone(tmp_path / name)
        (clone / "data" / "tau2" / "domains" / "toy" / name).unlink()
        with pytest.raises(ConfigError, match=f"env.path.*{name}"):
            resolve_env(env_cfg(clone))


def test_clone_fields_belong_to_tau2_only():
    with pytest.raises(ValueError, match="path: only for name: tau2"):
        EnvConfig(name="orders", path="/x")
    with pytest.raises(ValueError, match="user_client"):
        EnvConfig(name="tau2", user="llm")


def test_an_interpreter_or_dependency_mismatch_fails_before_the_first_step(tmp_path):
    clone = copy_clone(tmp_path / "version")
    (clone / "pyproject.toml").write_text('[project]\nname = "tau2"\nrequires-python = ">=3.99"\n')
    with pytest.raises(ConfigError, match=r"env.python.*>=3\.99"):
        resolve_env(env_cfg(clone))
    clone = copy_clone(tmp_path / "deps")
    model = clone / "src" / "tau2" / "domains" / "toy" / "data_model.py"
    model.write_text("import pydantic_not_installed_here\n" + model.read_text())
    with pytest.raises(ConfigError, match="env.python.*ModuleNotFoundError.*pydantic_not_installed_here"):
        resolve_env(env_cfg(clone))


def test_a_malformed_task_file_names_env_path(tmp_path):
    clone = copy_clone(tmp_path)
    (clone / "data" / "tau2" / "domains" / "toy" / "tasks.json").write_text('[{"id": "0"}]')
    with pytest.raises(ConfigError, match="env.path.*tasks.json task #0"):
        resolve_env(env_cfg(clone)).make_tasks()


# ---------------------------------------------------------------- hostile child ----
HOSTILE = {
    "flood": "import sys\nsys.stdin.readline()\nsys.stdout.write('x' * (6 * 1024 * 1024))\nsys.stdout.flush()\nimport time\ntime.sleep(30)\n",
    "garbage": "import sys\nsys.stdin.readline()\nprint('not json', flush=True)\n",
    "no_ok": "import sys\nsys.stdin.readline()\nprint('[1, 2]', flush=True)\n",
    "nan": "import sys\nsys.stdin.readline()\nprint('{\"ok\": NaN}', flush=True)\n",
    "exit": "import sys\nsys.stdin.readline()\nsys.exit(3)\n",
    "hang": "import sys, time\nsys.stdin.readline()\ntime.sleep(30)\n",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_child_is_a_bounded_clear_failure(tmp_path, monkeypatch, kind):
    script = tmp_path / "child.py"
    script.write_text(HOSTILE[kind])
    monkeypatch.setattr(proto, "CHILD", script)
    child = proto.Child(sys.executable, FIXTURE, "toy")
    t0 = time.monotonic()
    with pytest.raises(proto.ChildFailure) as info:
        child.request("hello", timeout_s=2.0)
    assert time.monotonic() - t0 < 10 and not child.alive
    assert len(str(info.value)) < 4000 and len(child._buf) <= proto.MAX_REPLY_BYTES + 65536
    child.close()


def test_a_child_that_stops_reading_cannot_block_a_request(tmp_path, monkeypatch):
    script = tmp_path / "child.py"
    script.write_text("import time\ntime.sleep(30)\n")  # never reads its input
    monkeypatch.setattr(proto, "CHILD", script)
    child = proto.Child(sys.executable, FIXTURE, "toy")
    t0 = time.monotonic()
    with pytest.raises(proto.ChildFailure, match="did not take the request"):
        child.request("call", timeout_s=1.0, name="x", arguments={"x": "a" * 500_000})  # over a pipe's buffer
    assert time.monotonic() - t0 < 10
    child.close()


def test_a_child_flooding_its_stderr_keeps_only_a_bounded_tail(tmp_path, monkeypatch):
    script = tmp_path / "child.py"
    script.write_text(
        "import sys\nsys.stdin.readline()\nfor _ in range(400):\n    sys.stderr.write('e' * 65536)\n"
        "sys.stderr.write('LAST WORDS')\nsys.stderr.flush()\nprint('{\"ok\": true}', flush=True)\nsys.exit(0)\n"
    )
    monkeypatch.setattr(proto, "CHILD", script)
    child = proto.Child(sys.executable, FIXTURE, "toy")
    assert child.request("hello", timeout_s=20.0) == {"ok": True}
    child.proc.wait(timeout=10)
    tail = child.stderr_tail()
    assert tail.endswith("LAST WORDS") and len(tail) <= proto.STDERR_TAIL
    assert sum(map(len, child._tail)) <= proto.STDERR_TAIL + 65536  # 25 MiB written, a few KiB kept
    child.close()


def test_a_hanging_or_flooding_tool_fails_the_episode_not_the_host(tmp_path):
    clone = copy_clone(tmp_path)
    tools = clone / "src" / "tau2" / "domains" / "toy" / "tools.py"
    text = tools.read_text().replace(
        "        return self._order(order_id)\n",
        '        if order_id == "#HANG":\n            import time\n\n            time.sleep(60)\n'
        '        if order_id == "#BIG":\n            return "y" * 300000\n        return self._order(order_id)\n',
    )
    tools.write_text(text)
    entry = resolve_env(env_cfg(clone, exclude_hackable=False))
    env = Tau2Env(*entry.make_env.args, tool_timeout_s=1.5)
    try:
        env.reset(task_of("2"))
        big = env.step("get_order_details", {"order_id": "#BIG"})
        assert big.ok and len(big.content) <= MAX_OBSERVATION_CHARS + 100
        hung = env.step("get_order_details", {"order_id": "#HANG"})
        assert not hung.ok and hung.error_kind in {"timeout", "tool_exception"}
        verdict = env.verify("shipped")
        assert not verdict.success and verdict.details.get("env_error") and "error" in verdict.details
        env.reset(task_of("2"))  # a new child for the next episode
        assert env.step("get_order_details", {"order_id": "#T1003"}).ok
        assert env.verify("It is shipped.").success
    finally:
        env.close()


# ---------------------------------------------------------------- a real clone ----
@pytest.mark.skipif(not os.environ.get("TAU2_CLONE"), reason="set TAU2_CLONE to a tau2-bench clone (with its .venv)")
def test_a_real_clone():
    cfg = EnvConfig(name="tau2", path=os.environ["TAU2_CLONE"], domain=os.environ.get("TAU2_DOMAIN", "retail"))
    entry = resolve_env(cfg)
    source = entry.make_tasks()
    env, expert = entry.make_env(), entry.make_expert()
    try:
        tasks = source.tasks("train", n=min(5, len(source.rows["train"])), seed=0)
        assert tasks and all(play(env, t, expert.act).success for t in tasks)
        assert all(benchmark_reward(play(env, t, tau2_attacks()[0].script)) < 1.0 for t in tasks)
    finally:
        env.close()


def test_scripted_turns_are_plain_actions():
    # the attacks and the expert yield only the two action types every scripted policy uses
    for attack in tau2_attacks():
        assert all(isinstance(a, (ToolAction, FinalAnswer)) for a in attack.script(task_of("0")))

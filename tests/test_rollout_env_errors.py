"""An environment error is its episode's failure (counted, logged), never the batch's, and the
environment is always closed (issue 56: a solution's output crashed ``verify`` and skipped ``close``)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
from conftest import ToyEnv

from mentorrl.contract import render_tool_call
from mentorrl.rollout import engine as engine_mod
from mentorrl.rollout.episode import Episode, close_env, run_text_turns

ECHO = render_tool_call("echo", {"text": "hello"})


class BrokenEnv(ToyEnv):
    """``verify`` and (optionally) ``step`` raise what a hostile workspace once made them raise."""

    def __init__(self, step_raises: bool = False, close_raises: bool = False):
        super().__init__()
        self.step_raises, self.close_raises, self.closed = step_raises, close_raises, 0

    def step(self, name, arguments):
        if self.step_raises:
            raise OSError("workspace gone")
        return super().step(name, arguments)

    def verify(self, final_answer):
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")

    def close(self):
        self.closed += 1
        super().close()
        if self.close_raises:
            raise RuntimeError("unmount failed")


@pytest.mark.parametrize("step_raises", [False, True])
def test_an_environment_error_fails_only_its_episode(step_raises, toy_task, make_contract, caplog):
    env = BrokenEnv(step_raises=step_raises)
    contract = make_contract(env=env, max_total_tokens=1024)
    with caplog.at_level(logging.WARNING, logger="mentorrl.rollout.episode"):
        traj = run_text_turns(contract, env, toy_task, [ECHO, "ok, done"])
    env.close()
    assert traj.reward is not None and not traj.reward.success
    assert "RecursionError" in traj.reward.details["error"]
    if step_raises:
        call = traj.tool_calls[0]
        assert not call.ok and call.error_kind == "tool_exception" and "workspace gone" in call.error
    assert sum("environment error" in r.message for r in caplog.records) == 1 + step_raises


def _slot(env, task, contract):
    ep = Episode(contract, env, task)
    ep.start()
    ids = contract.policy_turn_ids("ok")
    ep.add_policy_turn(ids, [0.0] * len(ids), stopped=True)
    return SimpleNamespace(episode=ep)


def test_the_engine_closes_the_env_whatever_verify_does(toy_task, make_contract, monkeypatch):
    env = BrokenEnv(close_raises=True)
    contract = make_contract(env=env, max_total_tokens=1024)
    sched = SimpleNamespace(close_envs=True, t_start=time.perf_counter())
    traj = engine_mod.StreamScheduler._verify(sched, _slot(env, toy_task, contract))
    assert not traj.reward.success and env.closed == 1  # verify raised, close raised: neither escaped

    def broken_finish(self):
        raise ValueError("reward composition failed")

    env2 = BrokenEnv()
    slot = _slot(env2, toy_task, contract)
    monkeypatch.setattr(Episode, "finish", broken_finish)
    with pytest.raises(ValueError):
        engine_mod.StreamScheduler._verify(sched, slot)
    assert env2.closed == 1  # closed even when the episode's own code failed


def test_close_env_logs_and_never_raises(caplog):
    envs = [BrokenEnv(close_raises=True) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="mentorrl.rollout.episode"):
        for e in envs:
            close_env(e)
    assert [e.closed for e in envs] == [1, 1, 1]
    assert sum("unmount failed" in r.message for r in caplog.records) == 3

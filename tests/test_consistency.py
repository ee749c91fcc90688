"""Per-batch train/rollout consistency checks on real (expert) trajectories with tool observations."""

from __future__ import annotations

import pytest

from mentorrl.train.consistency import batch_checks, policy_lag


@pytest.fixture
def batch(make_demos):
    contract, demos = make_demos(4)
    for i, t in enumerate(demos):
        t.policy_version = i
    return contract, demos


def _failed(contract, trajs, current):
    checks = batch_checks(trajs, current, contract.env_name, contract.env_version, contract.fingerprint())
    return {c.name: c.detail for c in checks if not c.passed}


def test_clean_batch_passes(batch):
    contract, trajs = batch
    assert _failed(contract, trajs, current=len(trajs) - 1) == {}
    assert policy_lag(trajs, 5) == {"policy_lag_mean": 5 - (len(trajs) - 1) / 2, "policy_lag_max": 5.0}


def test_each_doctored_field_fails_its_check(batch):
    contract, trajs = batch
    current = len(trajs) - 1
    obs = next(s for s in trajs[0].segments if s.role == "observation")
    trajs[0].loss_mask[obs.start + 1] = 1  # a tool-return token made trainable
    trajs[1].policy_version = current + 1  # from a future policy
    trajs[2].logprobs = trajs[2].logprobs[:-1]  # lengths disagree
    trajs[3].env_version = "0.0-other"
    failed = _failed(contract, trajs, current)
    assert set(failed) == {"observation_mask", "policy_version", "lengths", "env_version"}
    assert "observation tokens" in failed["observation_mask"] and trajs[0].id in failed["observation_mask"]
    assert f"v{current + 1} > v{current}" in failed["policy_version"]
    trajs[3].contract_fingerprint = "f" * 16
    assert "contract" in _failed(contract, trajs, current)

"""The rollout is an explicit object (:class:`mentorrl.rollout.Rollout`): what a rollout depends on
besides the model and the tasks is in it, never in a module global.

- two rollouts built from different ``rollout:`` sections, used alternately in one process, each
  decode with their own settings, and a rollout's output does not depend on what another did before;
- the rollout and distributed packages hold no mutable module-level state except the named caches
  below (which decide where work runs or which buffers it reuses, never what is sampled), no module
  there rebinds a global, and rolling out leaves every module global as it was.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import io
import logging
import pkgutil
import threading
import types
import typing
from pathlib import Path

import pytest
import torch

import mentorrl
from mentorrl.config import RolloutConfig, load_config
from mentorrl.rollout import BackendChoice, Rollout, RolloutSpec
from mentorrl.rollout.engine import RolloutEngine

PACKAGES = ("mentorrl.rollout", "mentorrl.distributed")
# Process-wide caches, each with why it cannot change what a rollout samples:
CACHES = {
    ("mentorrl.rollout.decoders", "_POOL"),  # slot-decoder KV buffers reused across rollouts (always overwritten)
    ("mentorrl.rollout.decoders", "_POOL_LOCK"),
    ("mentorrl.rollout.decoders", "_checked"),  # per model: whether the slot decoder matches its forward
    ("mentorrl.rollout.dispatch", "_COSTS"),  # measured tool-call costs: inline or in the pool, same result
    ("mentorrl.distributed.ray_workers", "_IDLE"),  # idle actor handles, explicitly reconfigured on reuse
}
IMMUTABLE = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    tuple,
    frozenset,
    range,
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MappingProxyType,
    logging.Logger,
    enum.Enum,
    property,
    staticmethod,
    classmethod,
    typing.TypeVar,
)


def _modules() -> list[types.ModuleType]:
    out = []
    for pkg_name in PACKAGES:
        pkg = importlib.import_module(pkg_name)
        out.append(pkg)
        for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
            if info.name.endswith(".vllm") or info.name.endswith(".vllm_worker"):
                continue  # import vllm (not installed here); read by the AST check below
            if info.name.startswith("mentorrl.distributed.") and importlib.util.find_spec("ray") is None:
                continue
            out.append(importlib.import_module(info.name))
    return out


def _is_constant(value) -> bool:
    if isinstance(value, IMMUTABLE):
        return True
    if type(value).__module__ in ("typing", "__future__"):
        return True  # typing aliases, `from __future__` features
    if any(c.__module__ in ("ray.actor", "ray.remote_function") for c in type(value).__mro__[1:2]):
        return True  # a class or function made remote with @ray.remote
    if dataclasses.is_dataclass(value):
        return type(value).__dataclass_params__.frozen
    return False


def _mutable_globals() -> set[tuple[str, str]]:
    """(module, name) of every module-level value in the rollout path that is not a constant."""
    return {
        (mod.__name__, name)
        for mod in _modules()
        for name, value in vars(mod).items()
        if not (name.startswith("__") and name.endswith("__")) and not _is_constant(value)
    }


def test_rollout_packages_hold_no_mutable_module_state_but_the_named_caches():
    assert _mutable_globals() == CACHES


def test_the_state_check_sees_a_module_global_sneaking_back(monkeypatch):
    import mentorrl.rollout.backends as backends

    monkeypatch.setattr(backends, "_ACTIVE", {"engine": None}, raising=False)
    assert ("mentorrl.rollout.backends", "_ACTIVE") in _mutable_globals()


def _global_statements(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Global):
                out.append(f"{path.name}:{node.lineno} global {', '.join(node.names)}")
    return out


def test_no_module_in_the_rollout_path_rebinds_a_global():
    """A ``None`` global set later with ``global`` (how the old backend choice hid) is caught here."""
    root = Path(mentorrl.__file__).parent
    assert _global_statements(root / "rollout") == []
    assert _global_statements(root / "distributed") == []


def test_the_global_check_sees_a_global_statement(tmp_path):
    (tmp_path / "m.py").write_text("_engine = None\n\ndef use():\n    global _engine\n    _engine = 1\n")
    assert _global_statements(tmp_path) == ["m.py:4 global _engine"]


# ------------------------------------------------------------------ two rollouts, one process -----
@pytest.fixture
def engines_built(monkeypatch):
    """(decoder, inline_tool_s) of every RolloutEngine built, in order."""
    built: list[tuple[str, float]] = []
    real = RolloutEngine.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        built.append((self.decoder, self.inline_tool_s))

    monkeypatch.setattr(RolloutEngine, "__init__", init)
    return built


def test_two_rollouts_with_their_own_configs_alternate_in_one_process(
    tool_happy_model, make_contract, orders_entry, orders_tasks, engines_built
):
    contract = make_contract()
    a = Rollout(contract, orders_entry.make_env, None, BackendChoice(RolloutConfig(decoder="hf", inline_tool_ms=0)))
    b = Rollout(contract, orders_entry.make_env, None, BackendChoice(RolloutConfig(decoder="slots")))
    tasks = orders_tasks[:3]
    first = a.run(tool_happy_model, tasks, seed=7)
    other = b.run(tool_happy_model, tasks, seed=7)
    again = a.run(tool_happy_model, tasks, seed=7)
    assert engines_built == [("hf", 0.0), ("slots", 0.005), ("hf", 0.0)]
    # what b did in between changes nothing in a's rollouts (both decoders sample the same tokens)
    assert [t.token_ids for t in first] == [t.token_ids for t in again] == [t.token_ids for t in other]


def test_reward_weights_travel_with_their_rollout(make_demos, orders_entry, orders_tasks):
    from mentorrl.rewards.compose import RewardWeights

    contract, _ = make_demos(1)
    expert = orders_entry.make_expert()
    plain = Rollout(contract, orders_entry.make_env)
    heavy = Rollout(contract, orders_entry.make_env, RewardWeights(tool=0.35))
    tasks = orders_tasks[:4]
    x, y, z = (
        plain.demonstrations(expert, tasks),
        heavy.demonstrations(expert, tasks),
        plain.demonstrations(expert, tasks),
    )
    assert [t.reward.total for t in x] == [t.reward.total for t in z]
    assert [t.task_id for t in x] == [t.task_id for t in y]
    assert all(b.reward.total >= a.reward.total for a, b in zip(x, y))
    assert any(b.reward.total > a.reward.total for a, b in zip(x, y))


def test_with_contract_shares_the_backend_and_the_spec_pickles(make_contract, orders_entry):
    import pickle

    r = Rollout(make_contract(), orders_entry.make_env, None, BackendChoice(RolloutConfig(decoder="hf")))
    warm = r.with_temperature(0.25)
    assert warm.backend is r.backend and warm.contract.sampling.temperature == 0.25
    assert r.with_temperature(None) is r
    spec = pickle.loads(pickle.dumps(r.spec()))
    assert isinstance(spec, RolloutSpec) and spec.config == r.backend.config
    built = spec.build()
    assert built.backend is not r.backend and built.backend.decoder == "hf"


def test_a_closed_workspace_closes_its_rollout(tmp_path, tokenizer, orders_entry, monkeypatch):
    from rich.console import Console

    from mentorrl.train.workspace import Workspace

    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "rollout.decoder=hf"])
    ws = Workspace(
        cfg=cfg,
        run_dir=tmp_path / "run",
        env_entry=orders_entry,
        console=Console(file=io.StringIO()),
        show_progress=False,
    )
    with pytest.raises(RuntimeError, match="bind_tokenizer"):
        _ = ws.rollout
    ws.bind_tokenizer(tokenizer)
    r = ws.rollout
    assert r is ws.rollout and r.contract is ws.contract and r.backend.decoder == "hf"
    assert r.weights == cfg.reward
    closed = threading.Event()
    monkeypatch.setattr(r.backend, "close", closed.set)
    with ws:
        pass
    assert closed.is_set()


def test_sync_without_an_engine_is_a_no_op(model, make_contract, orders_entry):
    r = Rollout(make_contract(), orders_entry.make_env)
    r.sync(model, 3)
    assert r.backend.engine is None
    r.close()


def test_rolling_out_leaves_every_module_global_as_it_was(tool_happy_model, make_contract, orders_entry, orders_tasks):
    mods = _modules()
    before = {(m.__name__, k): id(v) for m in mods for k, v in vars(m).items()}
    Rollout(make_contract(), orders_entry.make_env, None, BackendChoice(RolloutConfig(decoder="hf"))).run(
        tool_happy_model, orders_tasks[:2], seed=1
    )
    after = {(m.__name__, k): id(v) for m in mods for k, v in vars(m).items()}
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert changed <= CACHES, changed
    assert torch.is_grad_enabled()

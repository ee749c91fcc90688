"""OPD's terms: the config's ``opd.terms`` list (one schema per term, the legacy flat settings
translated into it), the registered pure functions (mentorrl.algos.opd_terms) and the inputs each
one declares, and the stage computing only the inputs the configured terms need."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mentorrl.algos.advantages import get_advantage_estimator
from mentorrl.algos.opd_terms import (
    ADVANTAGE_TERMS,
    INPUTS,
    TOKEN_TERMS,
    apply_token_terms,
    needed_inputs,
    token_advantages,
)
from mentorrl.config import OPD_TERM_SCHEMAS, ConfigError, dump_config, load_config
from mentorrl.opd.advantage import group_reward_weights
from mentorrl.train.recipes.opd import INPUT_BUILDERS, LOSS_TERMS, OPDStage, OPDStepData

CONFIGS = Path(__file__).resolve().parent.parent / "mentorrl" / "configs"


def names(cfg) -> list[str]:
    return [t.name for t in cfg.opd.terms]


# -------------------------------------------------------------------- config -----
def test_every_term_schema_has_one_runtime_function():
    runtime = [*TOKEN_TERMS, *ADVANTAGE_TERMS, *LOSS_TERMS]
    assert sorted(runtime) == sorted(OPD_TERM_SCHEMAS) and len(set(runtime)) == len(runtime)
    assert set(INPUT_BUILDERS) == set(INPUTS)


def test_the_terms_list_round_trips(tmp_path):
    cfg = load_config(
        None,
        [
            "opd.terms=[{name: topk, top_k: 4, divergence: jsd}, until_first_error, "
            "{name: short, top_frac: 0.2}, {name: reward_weighted, temperature: 2.0}]"
        ],
    )
    assert names(cfg) == ["topk", "until_first_error", "short", "reward_weighted"]
    assert cfg.opd.terms[0].top_k == 4 and cfg.opd.terms[2].top_frac == 0.2 and cfg.opd.terms[3].temperature == 2.0
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg
    legacy = load_config(None, ["opd.short={top_frac: 0.5}", "opd.reward_coef=0.5"])  # translated, then dumped as terms
    path.write_text(dump_config(legacy))
    assert load_config(path) == legacy and yaml.safe_load(path.read_text())["opd"]["short"] is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["opd.terms=[sampled_kl]", "opd.short={top_frac: 0.5}"], "legacy settings opd.short"),
        (["opd.terms=[topk]", "opd.loss=sampled"], "legacy settings opd.loss"),
        (["opd.terms=[sampled_kl]", "opd.mopd={step_weights: {}}"], "opd.mopd.step_weights"),
        (["opd.terms=[sampled_kl, center, center]"], "center more than once"),
        (["opd.terms=[center, until_first_error]"], "no advantage or loss term"),
        (["opd.terms=[{name: nope}]"], "opd.terms.0"),
        (["opd.terms=[{name: short}]"], "exactly one of threshold and top_frac"),
        (["opd.terms=[{name: topk, top_k: 0}]"], "opd.terms.0.topk.top_k"),
        (["opd.terms=[{name: sampled_kl, coef: .inf}]"], "finite"),
        (["opd.terms=[{name: env_advantage}]", "opd.samples_per_task=1"], "samples_per_task must be >= 2"),
    ],
)
def test_term_config_errors_name_the_problem(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


# legacy flag -> its values, drawn independently; the expected explicit list is written out below
LEGACY = {
    "loss": st.sampled_from([None, "sampled", "topk"]),
    "center": st.sampled_from([None, True, False]),
    "kl_coef": st.sampled_from([None, 0.0, 0.5]),
    "top_k": st.sampled_from([None, 4]),
    "distill_until": st.sampled_from([None, "end", "first_error"]),
    "step_weights": st.sampled_from([None, {}, {"tool_error_boost": 3.0}]),
    "short": st.sampled_from([None, {"top_frac": 0.5}, {"threshold": 0.1, "min_share": 0.5}]),
    "reward_weighted": st.sampled_from([None, {}, {"coef": 2.0}]),
    "reward_coef": st.sampled_from([None, 0.0, 0.5]),
    "cross_tokenizer": st.sampled_from([None, "chunk", "sequence"]),
    "rlsd": st.sampled_from([None, {}, {"target": "topk", "top_k": 4}]),
}


def _explicit(f: dict) -> list[dict]:
    """The explicit terms list the legacy flags ``f`` stand for, written independently of the translator."""
    hf, loss, kl = f["rlsd"] is None, f["loss"] or "sampled", 1.0 if f["kl_coef"] is None else f["kl_coef"]
    out = []
    if loss == "sampled" and hf:
        out.append({"name": "sampled_kl", "coef": kl})
    if loss == "topk":
        out.append({"name": "topk", "coef": kl, "top_k": f["top_k"] or 16})
    if f["distill_until"] == "first_error" and hf:
        out.append({"name": "until_first_error"})
    if f["step_weights"] is not None and hf:
        out.append({"name": "step_weights", **f["step_weights"]})
    if loss == "sampled" and f["center"] is not False and hf:
        out.append({"name": "center"})
    if f["short"] is not None:
        out.append({"name": "short", **f["short"]})
    if f["reward_weighted"] is not None:
        out.append({"name": "reward_weighted", **f["reward_weighted"]})
    rlsd = dict(f["rlsd"] or {})
    target = rlsd.pop("target", "selected")
    if f["rlsd"] is not None and target == "selected":
        out.append({"name": "rlsd_selected", **rlsd})
    if (f["reward_coef"] or 0) > 0:
        out.append({"name": "env_advantage", "coef": f["reward_coef"]})
    if f["rlsd"] is not None and target == "topk":
        out.append({"name": "rlsd_topk", **rlsd})
    if f["cross_tokenizer"] == "sequence":
        out.append({"name": "sequence_fallback"})
    return out


def _overrides(f: dict) -> list[str]:
    out = ["opd.samples_per_task=4"]
    if f["rlsd"] is not None:
        out += ["opd.teachers=[{name: me, kind: self}]", "opd.reward_coef=1.0"]
    for k, v in f.items():
        if v is None or (k == "reward_coef" and f["rlsd"] is not None):
            continue
        key = "opd.mopd.step_weights" if k == "step_weights" else f"opd.{k}"
        out.append(f"{key}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}")
    return out


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries(LEGACY))
def test_legacy_flags_map_to_the_same_terms_as_the_explicit_form(flags):
    if flags["rlsd"] is not None:
        flags = {**flags, "reward_coef": 1.0}
    legacy = load_config(None, _overrides(flags))
    terms = yaml.safe_dump(_explicit(flags), default_flow_style=True, width=1 << 20).strip()
    explicit = load_config(
        None, [o for o in _overrides(flags) if o.startswith(("opd.samples", "opd.teachers"))] + [f"opd.terms={terms}"]
    )
    assert legacy.opd.terms == explicit.opd.terms and legacy == explicit


SHIPPED_BEFORE = {  # the shipped OPD configs' settings before they were written as terms
    "opd.yaml": [
        "opd.loss=topk",
        "opd.divergence=reverse",
        "opd.top_k=16",
        "opd.kl_coef=1.0",
        "opd.distill_until=first_error",
        "opd.reward_coef=0.0",
    ],
    "shortopd.yaml": [
        "opd.loss=topk",
        "opd.divergence=reverse",
        "opd.top_k=16",
        "opd.kl_coef=1.0",
        "opd.distill_until=first_error",
        "opd.reward_coef=0.0",
        "opd.short={top_frac: 0.5, min_share: 0.25, full_gap: 0.5, ema: 0.5}",
    ],
    "mopd.yaml": [
        "opd.loss=sampled",
        "opd.kl_coef=1.0",
        "opd.distill_until=first_error",
        "opd.reward_coef=0.0",
        "opd.mopd.step_weights={tool_error_boost: 2.0, low_reward_boost: 1.5, low_reward: 0.5, "
        "entropy_threshold: 1.0, entropy_boost: 1.5}",
    ],
    "opd_cross.yaml": [
        "opd.loss=topk",
        "opd.divergence=reverse",
        "opd.top_k=16",
        "opd.kl_coef=1.0",
        "opd.distill_until=first_error",
        "opd.reward_coef=0.0",
        "opd.cross_tokenizer=chunk",
    ],
    "rlsd.yaml": [
        "opd.reward_coef=1.0",
        "opd.rlsd={coef: 0.5, target: topk, top_k: 8, teacher_temperature: 0.7, exploration_share: 0.25}",
    ],
    "reward_weighted.yaml": ["opd.reward_weighted={coef: 1.0, temperature: 0.5}"],
}


@pytest.mark.parametrize("name", sorted(SHIPPED_BEFORE))
def test_shipped_configs_keep_their_meaning(name):
    """Each shipped config, now written as terms, equals its former flat settings translated."""
    now = load_config(CONFIGS / name)
    before = load_config(CONFIGS / name, ["opd.terms=null"] + SHIPPED_BEFORE[name])
    assert before.opd.terms == now.opd.terms


# ------------------------------------------------------------------ functions -----
class Only(dict):
    """Inputs that refuse to be read beyond what the term declared."""

    def __getitem__(self, key):
        if key not in self:
            raise AssertionError(f"read undeclared input {key!r}")
        return dict.__getitem__(self, key)


def _all_inputs() -> dict:
    masks = [torch.tensor([0.0, 1.0, 1.0, 1.0]), torch.tensor([0.0, 0.0, 1.0, 1.0])]
    return {
        "masks": masks,
        "first_error": [torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.ones(4)],
        "gaps": [torch.tensor([0.0, 0.3, 2.0, 0.1]), torch.tensor([0.0, 0.0, 1.0, 0.01])],
        "tool_errors": [torch.tensor([0, 0, 1, 1]), torch.zeros(4)],
        "student_entropy": [torch.tensor([0.5, 2.0, 0.1, 0.1]), torch.full((4,), 3.0)],
        "rewards": torch.tensor([[1.0, 0.2]]),
        "success": torch.tensor([True, False]),
        "lengths": torch.tensor([3.0, 2.0]),
        "seed": 5,
    }


@pytest.mark.parametrize("name", sorted([*TOKEN_TERMS, *ADVANTAGE_TERMS]))
def test_a_term_runs_on_exactly_its_declared_inputs(name):
    table = TOKEN_TERMS if name in TOKEN_TERMS else ADVANTAGE_TERMS
    term, p = (
        table[name],
        OPD_TERM_SCHEMAS[name].model_validate({"name": name, **({"top_frac": 0.5} if name == "short" else {})}),
    )
    full = _all_inputs()
    kl = [torch.tensor([0.0, -0.3, 2.0, 0.1]), None]
    out, _ = term.fn(kl, Only({k: full[k] for k in term.needs}), p)  # reads nothing undeclared
    assert len(out) == 2
    for dropped in term.needs:  # and every declared input is read
        with pytest.raises(AssertionError, match="undeclared"):
            term.fn(kl, Only({k: full[k] for k in term.needs if k != dropped}), p)


def test_terms_compose_into_the_documented_advantage():
    masks = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 1.0, 1.0])]
    kl = [torch.tensor([0.0, -0.5, 0.25]), None]
    rewards = torch.tensor([[1.0, 0.0]])
    terms = load_config(
        None,
        [
            "opd.terms=[until_first_error, {name: sampled_kl, coef: 3.0}, {name: reward_weighted, "
            "coef: 2.0, temperature: 0.5}, {name: env_advantage, coef: 0.5}]"
        ],
    ).opd.terms
    x = {"masks": masks, "rewards": rewards, "first_error": [torch.tensor([1.0, 1.0, 0.0]), torch.ones(4)]}
    cut, m = apply_token_terms([t for t in terms if t.name in TOKEN_TERMS], kl, x)
    assert m == {} and cut[0].tolist() == [0.0, -0.5, 0.0] and cut[1] is None
    adv, _ = token_advantages(masks, [t for t in terms if t.name in ADVANTAGE_TERMS], cut, x)
    rw = 2.0 * group_reward_weights(rewards, 0.5).reshape(-1)
    env = 0.5 * get_advantage_estimator("grpo")(rewards, normalize_std=True).reshape(-1)
    assert torch.allclose(adv[0], (float(env[0]) + float(rw[0])) * masks[0] + 3.0 * cut[0])
    assert torch.allclose(adv[1], (float(env[1]) + float(rw[1])) * masks[1])


# ---------------------------------------------------------------------- stage -----
def _stage_for(overrides: list[str]):
    """An OPDStage's term selection without its workspace (no teachers loaded)."""
    cfg = load_config(None, overrides)
    stage = OPDStage.__new__(OPDStage)
    stage.cfg, stage.by_name = cfg.opd, {t.name: t for t in cfg.opd.terms}
    stage.needs = needed_inputs([t.name for t in cfg.opd.terms], LOSS_TERMS)
    return stage


def test_the_stage_computes_only_the_inputs_its_terms_need(monkeypatch):
    from mentorrl.train.recipes import opd

    calls = []
    monkeypatch.setitem(opd.INPUT_BUILDERS, "student_entropy", lambda stage, b, x: calls.append(1) or [])
    b = SimpleNamespace(trajs=[], rewards=torch.zeros(1, 2), data=OPDStepData(kl=[]), seeds=lambda p: 1)
    plain = _stage_for([])
    assert plain.needs == () and OPDStage.inputs(plain, b) == {} and not calls
    short = _stage_for(["opd.terms=[sampled_kl, until_first_error, {name: short, top_frac: 0.5}]"])
    assert short.needs == ("masks", "first_error", "gaps") and not calls
    mopd = _stage_for(["opd.mopd.step_weights={}"])
    assert "student_entropy" in mopd.needs
    OPDStage.inputs(mopd, b)
    assert calls == [1]
    rlsd = _stage_for(["opd.teachers=[{name: s, kind: self}]", "opd.rlsd={target: topk}", "opd.reward_coef=1.0"])
    assert rlsd.needs == ("masks", "rewards", "success", "lengths", "seed")

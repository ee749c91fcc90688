"""The OPD stage's weighting and selection logic on constructed inputs, its config errors, and the
OPD and self-evolving recipes end to end on the tiny model."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_resume import TINY_OVERRIDES
from typer.testing import CliRunner

from mentorrl.algos.opd_terms import center_term, rlsd_weights, short_term
from mentorrl.cli import app
from mentorrl.config import ConfigError, RLSDSelectedTerm, ShortOPDConfig, load_config
from mentorrl.contract import EFFECTIVE_BUDGET_KEY
from mentorrl.opd.advantage import (
    GapShare,
    group_reward_weights,
    kl_advantages,
    teacher_weights,
    tool_error_tokens,
    until_first_error,
)
from mentorrl.opd.signals import ChunkSignal
from mentorrl.train.recipes.evolve import curriculum_levels
from mentorrl.train.rundir import MetricsLog
from mentorrl.trajectory import RewardBreakdown, Segment, ToolCall, Trajectory


def traj(
    mask: list[int],
    logprobs: list[float] | None = None,
    reward: float = 0.0,
    success: bool = False,
    family: str = "f",
    **kw,
) -> Trajectory:
    n = len(mask)
    return Trajectory(
        id=kw.pop("id", "t"),
        task_id="task",
        family=family,
        token_ids=list(range(n)),
        loss_mask=mask,
        logprobs=logprobs or [(-0.5 if m else 0.0) for m in mask],
        env_name="e",
        env_version="1",
        reward=RewardBreakdown(total=reward, success=success),
        **kw,
    )


def token_signal(t: Trajectory, teacher_lp: list[float]) -> ChunkSignal:
    mask = torch.tensor(t.loss_mask, dtype=torch.bool)
    chunk_of = torch.full((len(t.loss_mask),), -1, dtype=torch.long)
    chunk_of[mask] = torch.arange(int(mask.sum()))
    return ChunkSignal(chunk_of, torch.tensor(teacher_lp, dtype=torch.float64), 10)


# ------------------------------------------------------------ MOPD weights -----
def test_teacher_weights_route_by_family_and_drop_teachers_without_a_signal():
    t = traj([0, 1, 1])
    sig = token_signal(t, [-1.0, -1.0])
    routes = {"math": {"a": 3.0, "b": 1.0}}
    w = teacher_weights(["math", "other", "math"], ["a", "b"], [[sig, sig, sig], [sig, sig, None]], routes)
    assert torch.allclose(w, torch.tensor([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]], dtype=torch.float64))


def test_teacher_weights_by_confidence_and_success_history():
    t = traj([0, 1, 1])
    confident, unsure = token_signal(t, [-0.1, -0.1]), token_signal(t, [-2.1, -2.1])
    w = teacher_weights(["f"], ["a", "b"], [[confident], [unsure]], {}, confidence_temperature=1.0)
    assert torch.allclose(w[0], torch.softmax(torch.tensor([-0.1, -2.1], dtype=torch.float64), 0))
    # history: a 9/10 verified, b 1/10: Beta(1,1) means 10/12 and 2/12
    h = teacher_weights(["f"], ["a", "b"], [[confident], [confident]], {}, history={"a": (9, 10), "b": (1, 10)})
    assert torch.allclose(h[0], torch.tensor([10 / 12, 2 / 12], dtype=torch.float64) / (12 / 12))


def test_same_tokenizer_teachers_mix_their_distributions():
    """Two same-tokenizer teachers with weights w: the target is log(w_a p_a + w_b p_b) per token."""
    t = traj([0, 1, 1], logprobs=[0.0, -1.0, -2.0])
    a, b = token_signal(t, [-0.5, -3.0]), token_signal(t, [-2.0, -0.2])
    w = torch.tensor([[0.25, 0.75]], dtype=torch.float64)
    adv = kl_advantages([t], [[a], [b]], w, [True, True])[0]
    mix = [math.log(0.25 * math.exp(x) + 0.75 * math.exp(y)) for x, y in ((-0.5, -2.0), (-3.0, -0.2))]
    assert adv[0] == 0 and torch.allclose(adv[1:], torch.tensor([mix[0] + 1.0, mix[1] + 2.0]), atol=1e-6)
    # a cross-tokenizer teacher's advantage is averaged in with its weight instead
    c = ChunkSignal(torch.tensor([-1, 0, 0]), torch.tensor([-1.0], dtype=torch.float64), 5)
    both = kl_advantages([t], [[a], [c]], torch.tensor([[0.5, 0.5]], dtype=torch.float64), [True, False])[0]
    want = 0.5 * torch.tensor([0.0, -0.5 + 1.0, -3.0 + 2.0]) + 0.5 * torch.tensor([0.0, -1.0 + 3.0, -1.0 + 3.0])
    assert torch.allclose(both, want, atol=1e-6)
    assert kl_advantages([t], [[None]], torch.zeros(1, 1, dtype=torch.float64), [True]) == [None]


def test_tool_error_tokens_mark_the_turn_whose_call_failed():
    segs = [
        Segment(role="prompt", start=0, end=2),
        Segment(role="policy", start=2, end=4),
        Segment(role="observation", start=4, end=5),
        Segment(role="policy", start=5, end=7),
    ]
    calls = [ToolCall(turn=1, name="x", arguments={}, raw="", error="boom", error_kind="tool_exception")]
    t = traj([0, 0, 1, 1, 0, 1, 1], segments=segs, tool_calls=calls)
    assert tool_error_tokens(t).tolist() == [False, False, True, True, False, False, False]
    # distillation stops after the failing turn; a clean trajectory keeps every policy token
    assert until_first_error(t).tolist() == [0, 0, 1, 1, 0, 0, 0]
    ok = traj(
        [0, 0, 1, 1, 0, 1, 1],
        segments=segs,
        tool_calls=[calls[0].model_copy(update={"error": None, "error_kind": None})],
    )
    assert until_first_error(ok).tolist() == [0, 0, 1, 1, 0, 1, 1]


# ------------------------------------------- reward-weighted, RLSD, ShortOPD -----
def test_group_reward_weights_are_a_softmax_per_group_scaled_to_mean_one():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    w = group_reward_weights(r, temperature=0.5)
    e = math.exp(2.0)
    assert torch.allclose(w[0], 4 * torch.tensor([e, 1, 1, 1]) / (e + 3)) and torch.allclose(w[1], torch.ones(4))


def test_rlsd_distils_only_verified_non_exploration_trajectories():
    trajs = [traj([0, 1, 1], reward=1.0, success=True, id=f"p{i}") for i in range(6)]
    trajs += [traj([0, 1, 1], reward=0.2, success=False, id=f"f{i}") for i in range(2)]
    x = {
        "rewards": torch.tensor([t.reward.total for t in trajs]),
        "seed": 3,
        "success": torch.tensor([t.reward.success for t in trajs]),
        "lengths": torch.tensor([float(t.num_policy_tokens) for t in trajs]),
    }
    w = rlsd_weights(x, RLSDSelectedTerm(exploration_share=0.25))
    from mentorrl.opd.rlsd import exploration_split

    explore = exploration_split(8, 0.25, 3)
    assert sum(explore) == 2
    for i, t in enumerate(trajs):
        assert (w[i] > 0) == (t.reward.success and not explore[i])
    assert abs(float(w[w > 0].mean()) - 1.0) < 1e-9


def test_short_opd_keeps_the_largest_gaps_and_reports_the_share():
    a = traj([0, 1, 1, 1, 1])
    b = traj([0, 0, 1, 1], id="b")
    kl = [torch.tensor([0.0, -0.1, -2.0, 0.3, -0.05]), torch.tensor([0.0, 0.0, 1.0, -0.01])]
    gaps = [k.abs() for k in kl]
    x = {"masks": [torch.tensor(t.loss_mask, dtype=torch.float32) for t in (a, b)], "gaps": gaps}
    out, m = short_term(kl, x, ShortOPDConfig(top_frac=0.5))
    share = m["distilled_token_share"]
    assert share == pytest.approx(3 / 6)
    assert out[0].tolist() == pytest.approx([0.0, 0.0, -2.0, 0.3, 0.0]) and out[1].tolist() == pytest.approx(
        [0, 0, 1.0, 0]
    )
    out, m = short_term(kl, x, ShortOPDConfig(threshold=0.2))
    share = m["distilled_token_share"]
    assert share == pytest.approx(3 / 6) and out[0][1] == 0


def test_gap_share_grows_with_the_measured_gap():
    b = GapShare(min_share=0.25, full_gap=0.5, ema=0.5)
    assert b.share("new") == 1.0  # unmeasured: nothing left out
    b.observe("easy", 0.0)
    b.observe("hard", 1.0)
    assert b.share("easy") == 0.25 and b.share("hard") == 1.0
    b.observe("easy", 0.5)  # ema 0.5: 0.25 -> halfway
    assert b.share("easy") == pytest.approx(0.625)
    b.observe("easy", float("nan"))  # ignored
    c = GapShare(0.25, 0.5, 0.5)
    c.load_state_dict(b.state_dict())
    assert c.share("easy") == pytest.approx(0.625)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError):
            GapShare(bad, 0.5, 0.5)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=40),
    st.dictionaries(st.sampled_from(["a", "b", "c"]), st.floats(0, 2)),
    st.integers(0, 2**31 - 1),
)
def test_gap_share_leaves_out_whole_tasks_never_cuts_one(families, gaps, seed):
    """What ShortOPD rolls out is a subset of the drawn tasks, in order, never empty, every unmeasured or
    full-gap family's tasks all kept, and the same draw from the same seed."""
    import random
    from types import SimpleNamespace

    s = GapShare(min_share=0.25, full_gap=0.5, ema=1.0)
    for f, g in gaps.items():
        s.observe(f, g)
    tasks = [SimpleNamespace(id=i, family=f) for i, f in enumerate(families)]
    kept = s.select(tasks, random.Random(seed))
    assert kept and [t.id for t in kept] == sorted(t.id for t in kept)
    assert kept == s.select(tasks, random.Random(seed))
    full = [t for t in tasks if s.share(t.family) == 1.0]
    assert all(t in kept for t in full)


def test_shortopd_refuses_the_removed_token_budgets():
    with pytest.raises(ConfigError, match="no longer cuts"):
        load_config(None, ["opd.short={top_frac: 0.5, min_budget: 96}"])


def test_curriculum_levels_grow_with_expert_solution_length(orders_tasks):
    tasks = orders_tasks[:40]
    calls = {t.id: (1 if i % 3 == 0 else 2 + (i % 2)) for i, t in enumerate(tasks)}
    levels = curriculum_levels(tasks, calls)
    sizes = [len(x) for x in levels]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes) and levels[-1] == tasks
    assert all(calls[t.id] == 1 and t.difficulty == "normal" for t in levels[0])


# ----------------------------------------------------------------- config -----
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["opd.rlsd={}"], "rlsd needs exactly one teacher, of kind self"),
        (["opd.teachers=[{name: s, kind: self}]"], "set opd.rlsd"),
        (["opd.teachers=[{name: a}, {name: a}]"], "teacher names must be unique"),
        (["opd.mopd={routes: {cancel_order: {nobody: 1}}}"], "unknown teachers"),
        (["opd.short={top_frac: 0.5, threshold: 0.1}"], "exactly one of threshold and top_frac"),
        (["opd.reward_weighted={}", "opd.samples_per_task=1"], "samples_per_task must be >= 2"),
        (["opd.teachers=[{name: s, kind: self}]", "opd.rlsd={}"], "set reward_coef > 0"),
        (["evolve.raise_above=0.1", "evolve.lower_below=0.2"], "must be below raise_above"),
    ],
)
def test_opd_config_errors_name_the_problem(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_topk_loss_refuses_a_teacher_without_topk_logprobs():
    from mentorrl.config import TeacherConfig
    from mentorrl.opd.teacher import Capability, MissingCapability, require
    from mentorrl.train.recipes.opd import needed_capabilities

    class ScoresOnly:  # e.g. a teacher behind an API that returns the sampled tokens' log-probs only
        name = "scores-only"
        capabilities = frozenset({Capability.TOKEN_LOGPROBS})

    cfg = load_config(None, ["opd.loss=topk"])
    with pytest.raises(MissingCapability, match="needs teacher 'scores-only' to provide topk_logprobs"):
        require(ScoresOnly(), needed_capabilities(cfg), "opd (loss topk)")
    assert TeacherConfig().kind == "hf"


def test_a_student_initialised_teacher_is_the_student_trained_on_and_is_cached_by_its_weights(policy, tmp_path):
    from mentorrl.config import TeacherConfig
    from mentorrl.models.build import load_policy
    from mentorrl.train.teachers import build_teacher, teacher_dir, weights_fingerprint
    from mentorrl.train.workspace import open_workspace

    tok, model = policy
    student = copy.deepcopy(model)
    cfg = load_config(
        None, [f"run_dir={tmp_path / 'run'}", f"opd.teachers_dir={tmp_path / 'teachers'}", "audit.preflight=false"]
    )
    ws = open_workspace(cfg, show_progress=False)
    ws.bind_tokenizer(tok)
    t = TeacherConfig(
        name="longer", build={"init": "student", "sft_steps": 2, "num_demos": 8, "batch_size": 4, "lr": 1e-4}
    )
    path = build_teacher(ws, t, student)
    assert path.parent.parent == teacher_dir(cfg, t, weights_fingerprint(student))
    t_tok, teacher = load_policy(path)
    assert t_tok.get_vocab() == tok.get_vocab()
    moved = [float((a - b).abs().max()) for a, b in zip(teacher.state_dict().values(), model.state_dict().values())]
    assert 0 < max(moved) < 1e-3  # trained on (Adam moves a weight <= lr a step) from the student, not a fresh init
    assert all(torch.equal(a, b) for a, b in zip(student.state_dict().values(), model.state_dict().values()))
    assert build_teacher(ws, t, student) == path  # cached: the same student gives the same directory
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)
    assert teacher_dir(cfg, t, weights_fingerprint(other)) != path.parent.parent
    with pytest.raises(ValueError, match="no student model was given"):
        build_teacher(ws, t)
    with pytest.raises(ConfigError, match="keeps the student's tokenizer and size"):
        load_config(None, ["opd.teachers=[{name: x, build: {init: student, vocab_size: 600}}]"])


# ------------------------------------------------------------- end to end -----
TEACHER_BUILD = "build: {sft_steps: 4, num_demos: 12, batch_size: 4}"
E2E = {
    "mopd-short-cross": [
        "opd.teachers=[{name: same, %s}, {name: cross, %s, build: {sft_steps: 4, num_demos: 12, "
        "batch_size: 4, vocab_size: 520}}]" % (TEACHER_BUILD, "temperature: 1.0"),
        "opd.short={top_frac: 0.5, min_share: 0.5}",
        "opd.mopd={confidence_temperature: 1.0, success_history: true, step_weights: {}}",
        "opd.reward_coef=0.5",
    ],
    "topk-reward-weighted": [
        "opd.teachers=[{name: same, build: {init: student, sft_steps: 4, num_demos: 12, batch_size: 4}}]",
        "opd.loss=topk",
        "opd.top_k=4",
        "opd.divergence=jsd",
        "opd.reward_weighted={}",
        "opd.epochs=2",
        "opd.distill_until=first_error",
    ],
    "cross-topk": [
        "opd.teachers=[{name: cross, build: {sft_steps: 4, num_demos: 12, batch_size: 4, vocab_size: 520}}]",
        "opd.loss=topk",
        "opd.top_k=4",
    ],
    "rlsd-topk": [
        "opd.teachers=[{name: self, kind: self}]",
        "opd.rlsd={target: topk, top_k: 4}",
        "opd.reward_coef=1.0",
    ],
    "cross-sequence-fallback": [
        "opd.teachers=[{name: cross, build: {sft_steps: 4, num_demos: 12, batch_size: 4, vocab_size: 520}}]",
        "opd.cross_tokenizer=sequence",
        "opd.reward_coef=1.0",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(E2E))
def test_opd_recipe_end_to_end_and_resume(tmp_path, variant):
    run = tmp_path / "run"
    args = ["demo", "--run-dir", str(run)]
    for ov in (
        TINY_OVERRIDES
        + [
            "recipe=[sft, opd]",
            "opd.steps=2",
            "opd.tasks_per_step=3",
            "opd.samples_per_task=2",
            "opd.eval_every=2",
            "opd.eval_tasks=4",
            "opd.checkpoint_every=1",
            "opd.teachers_dir=null",
            "eval.batch_size=4",
        ]
        + E2E[variant]
    ):
        args += ["--set", ov]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    recs = MetricsLog(run / "metrics.jsonl").read("opd")
    assert [r["step"] for r in recs] == [1, 2]
    assert all(math.isfinite(r["grad_norm"]) for r in recs if "grad_norm" in r)
    assert recs[-1]["rollout_tokens_total"] == sum(r["rollout_tokens"] for r in recs) > 0
    assert "heldout_success" in recs[1]
    report = json.loads((run / "report.json").read_text())
    assert report["opd"]["student_rollout_tokens"] == recs[-1]["rollout_tokens_total"]
    rows = [json.loads(x) for x in (run / "opd" / "signals-step-000001.jsonl").read_text().splitlines()]
    if variant == "mopd-short-cross":
        assert {"same", "cross"} == set(rows[0]["teachers"])
        for r in rows:  # the weights are stored per trajectory and sum to 1 over the teachers that scored it
            assert abs(sum(t["weight"] for t in r["teachers"].values()) - 1) < 1e-6
        # top_frac keeps ceil(0.5 * n) of n policy tokens: at most half, plus half a token
        assert all(0 < r["distilled_token_share"] <= 0.51 for r in recs), [r.get("distilled_token_share") for r in recs]
        assert recs[0]["alignment_failures"] == 0 and recs[0]["teacher_tokens"] > 0
        # ShortOPD spends its budget as whole tasks: the first step (no gap measured) rolls every task out
        assert recs[0]["short_tasks_kept"] == 1.0 and all(0 < r["short_tasks_kept"] <= 1 for r in recs)
        built = sorted(p.parent.parent.parent.name for p in (run / "teachers").glob("*/sft/final/DONE"))
        assert [b.split("-")[0] for b in built] == ["cross", "same"]
    if variant == "topk-reward-weighted":
        assert all("distill_loss" in r and math.isfinite(r["distill_loss"]) for r in recs)
        assert len(list((run / "teachers").glob("same-*/sft/final/DONE"))) == 1  # built once, from the student
    if variant == "cross-topk":
        assert all(math.isfinite(r["distill_loss"]) and 0 < r["topk_coverage"] <= 1 for r in recs)
    if variant == "rlsd-topk":
        assert all("rlsd_distilled" in r for r in recs)
    if variant == "cross-sequence-fallback":
        assert all("fallback_targets" in r and r["fallback_teacher_tokens"] > 0 for r in recs)
    before = (run / "metrics.jsonl").read_text()
    again = CliRunner().invoke(app, [*args, "--resume"], catch_exceptions=False)
    assert again.exit_code == 0 and (run / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_self_evolving_loop_keeps_versions_and_scores(tmp_path):
    run = tmp_path / "run"
    args = ["demo", "--run-dir", str(run)]
    for ov in TINY_OVERRIDES + [
        "recipe=[sft, evolve]",
        "evolve.iterations=2",
        "evolve.steps_per_iteration=2",
        "evolve.tasks_per_step=3",
        "evolve.samples_per_task=2",
        "evolve.eval_tasks=4",
        "evolve.window=4",
        "evolve.raise_above=0.01",
        "evolve.lower_below=0.0",
        "evolve.replay_batch=2",
        "eval.batch_size=4",
    ]:
        args += ["--set", ov]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    versions = json.loads((run / "evolve" / "versions.json").read_text())
    assert [v["version"] for v in versions] == [0, 1, 2]
    for v in versions:
        assert 0.0 <= v["heldout_success"] <= 1.0
        assert (v["path"] is not None) == v["accepted"]
        if v["accepted"]:
            assert (run / "evolve" / "versions" / f"v{v['version']}" / "model.safetensors").exists()
    recs = MetricsLog(run / "metrics.jsonl").read("evolve")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [("heldout_success" in r) for r in recs] == [False, True, False, True]
    # the teacher of iteration 2 is the version accepted at the end of iteration 1
    assert recs[2]["teacher_version"] == (1 if versions[1]["accepted"] else 0)
    assert (run / "evolve" / "replay.sqlite").exists()
    before = (run / "metrics.jsonl").read_text()
    again = CliRunner().invoke(app, [*args, "--resume"], catch_exceptions=False)
    assert again.exit_code == 0 and (run / "metrics.jsonl").read_text() == before


def test_a_budgeted_episode_stops_at_its_budget(make_contract, orders_entry, tool_happy_model):
    from mentorrl.rollout.runner import rollout_tasks

    contract = make_contract(max_total_tokens=640)
    tasks = orders_entry.make_tasks().tasks("train", 6, 4)
    trajs = rollout_tasks(
        tool_happy_model,
        contract,
        orders_entry.make_env,
        tasks * 2,
        seed=1,
        token_budgets=[None] * len(tasks) + [40] * len(tasks),
    )
    full, short = trajs[: len(tasks)], trajs[len(tasks) :]
    for t in short:
        prompt = t.segments[0].end
        assert len(t.token_ids) <= prompt + 40 and t.sampling[EFFECTIVE_BUDGET_KEY] == prompt + 40
    # the trajectory records the configured limit and its episode's whole budget under separate keys
    assert all(t.sampling["max_total_tokens"] == 640 for t in trajs)
    assert all(
        t.sampling[EFFECTIVE_BUDGET_KEY] == contract.max_total_tokens == 640 + contract.system_tokens for t in full
    )
    # the same tasks unbudgeted run past the budget (which episodes do depends on sampling; some must)
    assert any(len(t.token_ids) > t.segments[0].end + 40 for t in full), [
        len(t.token_ids) - t.segments[0].end for t in full
    ]
    with pytest.raises(ValueError, match="token_budgets has 1 entries for 2 tasks"):
        rollout_tasks(tool_happy_model, contract, orders_entry.make_env, tasks[:1] * 2, token_budgets=[100])


def test_sampled_advantages_are_centred_over_the_tokens_they_cover():
    kl = [torch.tensor([0.0, -1.0, -3.0]), None, torch.tensor([0.0, 0.0, -2.0])]
    out, _ = center_term(kl)
    assert out[1] is None
    assert out[0].tolist() == pytest.approx([0.0, 1.0, -1.0]) and out[2].tolist() == pytest.approx([0.0, 0.0, 0.0])


def test_weights_fingerprint_covers_every_tensor_kind_and_value():
    from mentorrl.train.teachers import weights_fingerprint

    def module(scale: float) -> torch.nn.Module:
        m = torch.nn.Module()
        m.register_buffer("scale", torch.tensor(scale))  # 0-dim
        m.register_buffer("empty", torch.zeros(0))
        m.register_buffer("bf16", torch.ones(3, dtype=torch.bfloat16))
        return m

    assert weights_fingerprint(module(2.0)) == weights_fingerprint(module(2.0))
    assert weights_fingerprint(module(2.0)) != weights_fingerprint(module(2.5))

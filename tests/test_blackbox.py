"""Black-box OPD pieces on constructed inputs: the acting teacher's agreement signals, the
candidate soft-label loss, the exact sequence-level update, fused rewards, step advantages,
preference pairs and corrections replayed from the student's prefix."""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch

from mentorrl.algos.preference import soft_label_loss
from mentorrl.chat import assistant_message, trajectory_messages
from mentorrl.config import OptimConfig
from mentorrl.contract import parse_action
from mentorrl.opd.remote_teacher import ActingTeacher, StudentEpisode, TrajectoryScore, action_agreement
from mentorrl.train.learner import Learner
from mentorrl.train.recipes.blackbox import (
    candidate_trajectory,
    corrected_trajectory,
    fused_rewards,
    preference_pairs,
    ranking_scores,
    step_advantages,
)

CALL = '<tool_call>{"name": "get_order", "arguments": {"order_id": 7}}</tool_call>'
OTHER_ARGS = '<tool_call>{"name": "get_order", "arguments": {"order_id": 8}}</tool_call>'
OTHER_TOOL = '<tool_call>{"name": "cancel_order", "arguments": {"order_id": 7}}</tool_call>'


class FakeClient:
    """Answers ``complete`` from a function of the messages; counts like the real client."""

    def __init__(self, answer):
        self.answer, self.calls = answer, 0
        self.stats: Counter[str] = Counter()

    def complete(self, messages, **params):
        self.calls += 1
        return self.answer(messages, params)

    def _count(self, key, n=1):
        self.stats[key] += n


def test_action_agreement_grades_tool_calls_and_answers():
    a = parse_action
    assert action_agreement(a(CALL), a(CALL)) == 1.0
    assert action_agreement(a(OTHER_ARGS), a(CALL)) == 0.5
    assert action_agreement(a(OTHER_TOOL), a(CALL)) == 0.0
    assert action_agreement(a("Order 7 shipped"), a("order 7 shipped")) == 1.0
    assert action_agreement(a("Order 7 shipped"), a("Order 8 shipped")) == pytest.approx(2 / 4)
    assert action_agreement(a("<tool_call>{bad</tool_call>"), a("<tool_call>{bad</tool_call>")) == 0.0
    assert action_agreement(a(CALL), a("Order 7 shipped")) == 0.0


def _episode(turns: list[str], demo) -> StudentEpisode:
    msgs = [{"role": "user", "content": "where is order 7"}]
    for i, t in enumerate(turns):
        msgs.append(assistant_message(t))
        if i < len(turns) - 1:
            msgs.append({"role": "tool", "content": '{"status": "shipped"}'})
    traj = demo.model_copy(update={"finish_reason": "answer"})
    return StudentEpisode(task=None, traj=traj, messages=msgs)


def test_acting_teacher_scores_turns_by_agreement_and_names_the_first_wrong_one(make_demos):
    _, demos = make_demos(1)

    # the teacher: get_order(7) at the start, then the answer "Order 7 shipped"; 4 samples, 1 of them off
    def answer(messages, params):
        assert params["n"] == 4 and "logprobs" not in params
        first = len([m for m in messages if m["role"] == "assistant"]) == 0
        good = assistant_message(CALL if first else "Order 7 shipped")
        bad = assistant_message(OTHER_ARGS if first else "Order 7 lost")
        return [good, good, good, bad]

    teacher = ActingTeacher(FakeClient(answer), samples=4)
    right = _episode([CALL, "Order 7 shipped"], demos[0])
    c = teacher.critique(right)
    assert c.scores == pytest.approx([(3 + 0.5) / 4, (3 + 0.5) / 4]) and c.first_wrong is None
    wrong = _episode([OTHER_TOOL, "Order 7 shipped"], demos[0])
    c = teacher.critique(wrong)
    assert c.scores[0] == 0.0 and c.first_wrong == 0
    assert c.correct_action["tool_calls"][0]["function"]["name"] == "get_order"  # the teacher's majority action
    s_right, s_wrong = teacher.score(right), teacher.score(wrong)
    assert s_right.dims["task_success"] > s_wrong.dims["task_success"] == 0.0
    assert teacher.rank([right, wrong]) == [s_right.overall(), s_wrong.overall()]
    calls = teacher.client.calls
    teacher.score(right)
    assert teacher.client.calls == calls  # states already asked about are memoised
    scores = teacher.rank_actions(right.messages[:1], [assistant_message(CALL), assistant_message(OTHER_TOOL)])
    assert scores == [pytest.approx(3.5 / 4), 0.0]


def test_acting_teacher_returns_none_when_the_teacher_fails(make_demos):
    _, demos = make_demos(1)
    teacher = ActingTeacher(FakeClient(lambda m, p: None), samples=2)
    ep = _episode([CALL, "done"], demos[0])
    assert teacher.critique(ep) is None and teacher.score(ep) is None and teacher.rank([ep, ep]) is None
    assert teacher.rank_actions(ep.messages[:1], [assistant_message(CALL)]) is None


def test_trajectory_score_overall_uses_the_weights_of_the_dimensions_given():
    s = TrajectoryScore({"task_success": 1.0, "efficiency": 0.0})
    assert s.overall() == 0.5
    assert s.overall({"task_success": 3, "efficiency": 1, "safety": 5}) == 0.75  # safety not given: left out
    with pytest.raises(ValueError, match="no weight"):
        s.overall({"safety": 1.0})


def test_soft_label_loss_against_hand_computed_values():
    student = torch.tensor([0.0, 0.0], requires_grad=True)
    teacher = torch.tensor([1.0, 0.0])
    loss, m = soft_label_loss(student, teacher, temperature=1.0)
    p = math.e / (math.e + 1)
    assert loss.item() == pytest.approx(math.log(2))
    assert m["soft_label_kl"] == pytest.approx(math.log(2) + p * math.log(p) + (1 - p) * math.log(1 - p))
    loss.backward()
    assert student.grad.tolist() == pytest.approx([0.5 - p, p - 0.5])  # raise the teacher's favourite
    # a sharper temperature moves the target towards one-hot; matching logits give zero KL
    _, m = soft_label_loss(torch.tensor([[2.0, 0.0]]), torch.tensor([[0.2, 0.0]]), temperature=0.1)
    assert m["soft_label_kl"] == pytest.approx(0.0, abs=1e-6) and m["top_agreement"] == 1.0
    with pytest.raises(ValueError):
        soft_label_loss(torch.zeros(1), torch.zeros(1))


def test_sequence_step_is_exact_whatever_the_micro_batch(make_demos, model, tokenizer):
    """The two-pass update equals backpropagating the loss of sequence log-probs directly."""
    from mentorrl.algos.preference import sequence_logprobs
    from mentorrl.models.batch import collate, forward_logprobs
    from mentorrl.train.learner import pad_token_values

    contract, demos = make_demos(4)
    trajs = demos[:4]
    masks = [torch.tensor(t.loss_mask) for t in trajs]
    target = torch.tensor([0.7, 0.1, 0.1, 0.1])

    def objective(s):
        return soft_label_loss(s, target, temperature=1.0)

    def learner_for(
        m, mbs
    ):  # plain SGD: the update is the (clipped) gradient itself, so equal updates = equal gradients
        learner = Learner(m, OptimConfig(lr=1.0, micro_batch_size=mbs), contract.pad_token_id)
        learner.optimizer = torch.optim.SGD(m.parameters(), lr=1.0)
        learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda _: 1.0)
        return learner

    after = []
    for mbs in (1, 4):
        m = copy.deepcopy(model)
        learner_for(m, mbs).sequence_step(trajs, masks, objective, average=True)
        after.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    # direct: one forward with gradient, the same optimiser
    m = copy.deepcopy(model)
    learner = learner_for(m, 4)
    m.train()
    mb = collate(trajs, contract.pad_token_id)
    lp, _ = forward_logprobs(m, mb, 1.0)
    s = sequence_logprobs(lp, pad_token_values(masks, mb.input_ids.shape[1]), average=True)
    objective(s)[0].backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), learner.cfg.max_grad_norm)
    learner.optimizer.step()
    direct = torch.cat([p.detach().flatten() for p in m.parameters()])
    base = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (after[0] - base).abs().max() > 1e-4  # it moved
    assert torch.allclose(after[0], after[1], atol=1e-6) and torch.allclose(after[0], direct, atol=1e-6)


def test_fused_rewards_leave_hard_constraints_and_unscored_to_the_verifier(make_demos):
    _, demos = make_demos(3)
    a, b, c = (d.model_copy(deep=True) for d in demos[:3])
    a.reward.total, b.reward.total, c.reward.total = 1.0, 0.2, 0.0
    c.reward.violations = ["cancelled the wrong order"]
    r, fused = fused_rewards([a, b, c], [0.0, None, 1.0], coef=0.25)
    assert r.tolist() == pytest.approx([0.75, 0.2, 0.0]) and fused == 1


def test_step_advantages_shift_each_turn_by_its_standardised_score(make_demos):
    _, demos = make_demos(2)
    t = demos[0]
    turns = [s for s in t.segments if s.role == "policy"]
    assert len(turns) >= 2
    scores = [1.0] + [0.0] * (len(turns) - 1)
    adv = step_advantages([t], torch.tensor([0.5]), [scores], coef=1.0)[0]
    flat = torch.tensor(scores)
    z = (flat - flat.mean()) / flat.std(unbiased=False)
    for seg, zi in zip(turns, z.tolist()):
        assert torch.allclose(adv[seg.start : seg.end], torch.full((seg.end - seg.start,), 0.5 + zi))
    assert adv[torch.tensor(t.loss_mask) == 0].abs().sum() == 0
    # an unscored trajectory keeps its outcome advantage only
    plain = step_advantages([t], torch.tensor([0.5]), [None], coef=1.0)[0]
    assert torch.equal(plain, torch.tensor(t.loss_mask, dtype=torch.float32) * 0.5)


def test_preference_pairs_take_best_and_worst_and_skip_ties(make_demos):
    _, demos = make_demos(4)
    pairs, m = preference_pairs([demos[:3], demos[:2], demos[2:4]], [[0.2, 0.9, 0.1], [0.5, 0.5], None], min_margin=0.1)
    assert len(pairs) == 1 and m == {"ties": 1.0, "teacher_skips": 1.0, "vetoed": 0.0}
    chosen, rejected, cm, rm = pairs[0]
    assert chosen is demos[1] and rejected is demos[2]
    every, m = preference_pairs([demos[:3]], [[0.2, 0.9, 0.1]], min_margin=0.1, which="all")
    assert [(c.id, r.id) for c, r, _, _ in every] == [
        (demos[0].id, demos[2].id),
        (demos[1].id, demos[0].id),
        (demos[1].id, demos[2].id),
    ]  # 0.2 vs 0.1 passes, ties none
    shared = next(i for i, (x, y) in enumerate(zip(chosen.token_ids, rejected.token_ids)) if x != y)
    assert not any(cm[:shared]) and any(cm) and any(rm)


def test_ranking_scores_fuse_the_verifier_and_the_teacher_by_the_coefficient(make_demos):
    _, demos = make_demos(3)
    a, b, c = (d.model_copy(deep=True) for d in demos[:3])
    a.reward.total, b.reward.total, c.reward.total = 1.2, 0.0, -1.0
    c.reward.violations = ["refunded twice"]
    group = [a, b, c]
    teacher = [0.2, 0.8, 1.0]
    assert ranking_scores(group, teacher, 1.0) == pytest.approx([0.2, 0.8, -1.0])  # the teacher; violations stay
    assert ranking_scores(group, teacher, 0.5) == pytest.approx([0.7, 0.4, -1.0])  # the verifier breaks the teacher
    assert ranking_scores(group, None, 0.0) == [1.2, 0.0, -1.0]  # verifier alone needs no teacher
    assert ranking_scores(group, None, 0.5) is None  # the teacher failed: the group is skipped
    pairs, _ = preference_pairs([group], [ranking_scores(group, teacher, 0.5)], min_margin=0.1, which="all")
    assert [(x.id, y.id) for x, y, _, _ in pairs][0] == (a.id, b.id)


def test_a_correction_replays_the_student_prefix_and_trains_only_the_teacher_turns(make_demos, tokenizer, orders_entry):
    """With the expert as the 'teacher', correcting from turn 1 rebuilds the expert's own trajectory
    token for token; only the turns after the prefix are trained on."""
    from types import SimpleNamespace

    contract, demos = make_demos(6)
    traj = next(d for d in demos if len([s for s in d.segments if s.role == "policy"]) >= 2)
    user = (
        tokenizer.decode(traj.token_ids, skip_special_tokens=False)
        .split("<|im_start|>user\n")[1]
        .split("<|im_end|>")[0]
    )
    msgs = trajectory_messages(traj, tokenizer, contract.system_text(), user)
    task = next(t for t in orders_entry.make_tasks().tasks("train", 6, 0) if t.id == traj.task_id)
    ep = StudentEpisode(task, traj, msgs)

    class ExpertTeacher:
        def act(self, messages, n=1, temperature=None):
            k = sum(m["role"] == "assistant" for m in messages)
            return [msgs[ep.turn_indices[k]]]

    env_entry = orders_entry
    ws = SimpleNamespace(contract=contract, cfg=SimpleNamespace(reward=None), make_env=env_entry.make_env)
    fixed = corrected_trajectory(ws, ep, 1, ExpertTeacher())
    assert fixed.token_ids == traj.token_ids and fixed.reward.success
    turns = [s for s in traj.segments if s.role == "policy"]
    assert not any(fixed.loss_mask[: turns[1].start])
    assert fixed.loss_mask[turns[1].start :] == traj.loss_mask[turns[1].start :]
    assert fixed.source == "teacher"


def test_candidate_trajectory_trains_only_the_candidate_turn(make_demos):
    contract, demos = make_demos(1)
    t = demos[0]
    seg = [s for s in t.segments if s.role == "policy"][1]
    cand = candidate_trajectory(t, seg.start, [5, 6, contract.im_end_id])
    assert cand.token_ids[: seg.start] == t.token_ids[: seg.start] and cand.token_ids[seg.start :] == [
        5,
        6,
        contract.im_end_id,
    ]
    assert cand.loss_mask == [0] * seg.start + [1, 1, 1] and cand.segments[-1].role == "policy"


# ---------------------------------------------------------- prompted teacher (HTTP) -----
def _reply(content: str) -> str:
    import json

    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})


def _prompted(url: str, route: str):
    from mentorrl.clients.config import ClientConfig
    from mentorrl.clients.openai_api import TeacherClient
    from mentorrl.opd.remote_teacher import PromptedTeacher

    cfg = ClientConfig(base_url=f"{url}/{route}/v1", model="judge", timeout_s=2.0, max_retries=0, api_key_env=None)
    return PromptedTeacher(TeacherClient(cfg, sleep=lambda s: None))


def test_prompted_teacher_reads_json_rankings_critiques_and_scores(server, make_demos, orders_entry):
    script, url = server
    _, demos = make_demos(1)
    task = orders_entry.make_tasks().tasks("train", 1, 0)[0]
    ep = _episode([CALL, "Order 7 shipped"], demos[0])
    ep = StudentEpisode(task, ep.traj, ep.messages)
    script.plans["rank"] = [(200, _reply('{"scores": [0.9, 0.1], "reason": "B cancelled the order"}'))]
    t = _prompted(url, "rank")
    assert t.rank([ep, ep]) == [0.9, 0.1]
    asked = script.requests[-1]["messages"][-1]["content"]
    assert "Candidate 2" in asked and "calls get_order" in asked and "answers: Order 7 shipped" in asked
    script.plans["crit"] = [
        (
            200,
            _reply(
                '```json\n{"step_scores": [1.0, 0.2], "first_wrong_step": 2, '
                '"correct_action": {"answer": "Order 7 has shipped"}}\n```'
            ),
        )
    ]
    c = _prompted(url, "crit").critique(ep)
    assert c.scores == [1.0, 0.2] and c.first_wrong == 1 and c.correct_action["content"] == "Order 7 has shipped"
    script.plans["acts"] = [(200, _reply('{"scores": [1.0, 0.0]}'))]
    assert _prompted(url, "acts").rank_actions(
        ep.messages[:1], [assistant_message(CALL), assistant_message(OTHER_TOOL)]
    ) == [1.0, 0.0]
    rubric = (
        '{"task_success": 1, "tool_correctness": 0.5, "state_tracking": 1, "efficiency": 1, '
        '"final_answer": 1, "safety": 1, "reason": "ok"}'
    )
    script.plans["score"] = [(200, _reply(rubric))]
    s = _prompted(url, "score").score(ep)
    assert s.dims["tool_correctness"] == 0.5 and len(s.dims) == 6 and s.reason == "ok"
    assert task.prompt in script.requests[-1]["messages"][-1]["content"]  # the LLM judge's rubric prompt


@pytest.mark.parametrize(
    "route, answer",
    [
        ("count", '{"scores": [0.5]}'),  # one score for two candidates
        ("range", '{"scores": [1.5, 0.0]}'),  # outside [0, 1]
        ("step", '{"step_scores": [1.0, 0.0], "first_wrong_step": 5}'),  # no such step
        ("prose", "Candidate 1 is better."),  # not JSON at all
    ],
)
def test_prompted_teacher_counts_and_skips_answers_that_do_not_fit(server, make_demos, route, answer):
    script, url = server
    _, demos = make_demos(1)
    ep = _episode([CALL, "Order 7 shipped"], demos[0])
    script.plans[route] = [(200, _reply(answer))]
    t = _prompted(url, route)
    out = t.critique(ep) if route == "step" else t.rank([ep, ep])
    assert out is None and t.client.stats["invalid_structured"] == 1


@pytest.mark.parametrize("loss", ["dpo", "ipo", "orpo", "dpo+nll", "dpo+average"])
def test_preference_update_runs_each_loss_on_agent_pairs(make_demos, model, loss):
    from mentorrl.config import BlackBoxConfig
    from mentorrl.train.recipes.blackbox import preference_update

    contract, demos = make_demos(4)
    pairs, _ = preference_pairs([demos[:2], demos[2:4]], [[1.0, 0.0], [0.0, 1.0]], min_margin=0.1)
    o = BlackBoxConfig(
        recipe="ranking",
        preference={"loss": loss.split("+")[0], "nll_coef": 1.0 if "nll" in loss else 0, "average": "average" in loss},
    )
    policy = copy.deepcopy(model)
    learner = Learner(policy, OptimConfig(lr=1e-3, micro_batch_size=2), contract.pad_token_id)
    m = preference_update(learner, copy.deepcopy(model), pairs, o)
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["skipped_update"] == 0.0
    if loss in (
        "dpo",
        "dpo+average",
    ):  # policy == reference before the step: every implicit reward is 0, the loss log 2
        assert m["loss"] == pytest.approx(math.log(2)) and m["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    if loss == "orpo":
        assert m["nll"] > 0
    if loss == "dpo+nll":  # the chosen side's token-mean NLL, added to DPO's log 2
        chosen = [c for c, _, _, _ in pairs]
        lp = Learner(copy.deepcopy(model), OptimConfig(), contract.pad_token_id).sequence_logprobs(
            chosen, [torch.tensor(c.loss_mask) for c in chosen], average=True
        )
        assert m["chosen_nll"] == pytest.approx(-lp.mean().item(), rel=1e-5)
        assert m["loss"] == pytest.approx(math.log(2) + m["chosen_nll"], rel=1e-5)


def test_teacher_calls_run_concurrently_up_to_the_client_bound_and_keep_their_order():
    import threading
    import time
    from types import SimpleNamespace

    from mentorrl.train.recipes.blackbox import teacher_map

    live, peak, lock = [0], [0], threading.Lock()

    def slow(x):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.05)
        with lock:
            live[0] -= 1
        return x * 2

    teacher = SimpleNamespace(client=SimpleNamespace(config=SimpleNamespace(max_concurrency=3)))
    assert teacher_map(teacher, slow, list(range(9))) == [x * 2 for x in range(9)]
    assert peak[0] == 3
    live[0] = peak[0] = 0
    assert teacher_map(SimpleNamespace(client=FakeClient(None)), slow, [1, 2]) == [2, 4] and peak[0] == 1


def test_the_verifier_vetoes_a_teacher_preference_it_contradicts(make_demos):
    _, demos = make_demos(2)
    good, bad = (d.model_copy(deep=True) for d in demos[:2])
    good.reward.success, bad.reward.success = True, False
    eps = [good, bad]
    pairs, m = preference_pairs([eps], [[0.1, 0.9]], min_margin=0.1)  # the teacher prefers the failure
    assert pairs == [] and m["vetoed"] == 1.0
    pairs, _ = preference_pairs([eps], [[0.1, 0.9]], min_margin=0.1, veto=False)
    assert pairs[0][0] is bad
    bad.reward.success, bad.reward.violations = True, ["refunded twice"]
    assert preference_pairs([eps], [[0.1, 0.9]], min_margin=0.1)[1]["vetoed"] == 1.0  # a hard constraint, too
    pairs, _ = preference_pairs([eps], [[0.9, 0.1]], min_margin=0.1)
    assert pairs[0][0] is good


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["blackbox.recipe=ranking", "blackbox.samples_per_task=1"], "samples_per_task must be >= 2"),
        (["blackbox.recipe=imitate"], "blackbox.recipe"),
        (["blackbox.teacher.mode=telepathy"], "blackbox.teacher.mode"),
        (["blackbox.preference.label_smoothing=0.5"], "blackbox.preference.label_smoothing"),
        (["blackbox.teacher.client.timeout_s=0"], "blackbox.teacher.client.timeout_s"),
        (["blackbox.teacher.serve={path: x, colour: red}"], "colour"),
        (["blackbox.preference.teacher_coef=1.5"], "blackbox.preference.teacher_coef"),
        (["blackbox.actions.loss=hinge"], "blackbox.actions.loss"),
    ],
)
def test_blackbox_config_errors_name_the_field(overrides, message):
    from mentorrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(None, overrides)


def test_every_configurable_recipe_is_registered_with_its_capabilities():
    from mentorrl.config import BLACKBOX_RECIPES
    from mentorrl.opd.teacher import Capability
    from mentorrl.train.recipes.blackbox import NEEDS, RECIPES

    assert set(RECIPES) == set(BLACKBOX_RECIPES)
    assert NEEDS["correction"] == [Capability.STEP_CRITIQUE, Capability.SAMPLING]
    assert NEEDS["actions"] == [Capability.ACTION_RANKING, Capability.SAMPLING]

"""The trajectory record: lossless JSONL round trip and validation."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from mentorrl.trajectory import RewardBreakdown, Segment, ToolCall, Trajectory, dumps_compact, read_jsonl, write_jsonl

AWKWARD_FLOATS = [0.1 + 0.2, -1e-9, 1e-300, -0.0, 5e-324, 1 / 3, -123456.78901234567, 2.0**-30]


def make_traj(i: int = 0, **kw) -> Trajectory:
    n = 9
    base = dict(
        id=f"t-{i}",
        task_id=f"task-{i}",
        family="refund",
        split="heldout",
        difficulty="adversarial",
        token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9][:n],
        loss_mask=[0, 0, 0, 1, 1, 0, 0, 1, 1],
        logprobs=[0.0, 0.0, 0.0, 0.1 + 0.2, -1e-9, 0.0, 0.0, -3.0000000000000004, -1 / 3],
        segments=[
            Segment(role="prompt", start=0, end=3),
            Segment(role="policy", start=3, end=5),
            Segment(role="observation", start=5, end=7),
            Segment(role="policy", start=7, end=9),
        ],
        policy_version=7,
        env_name="orders",
        env_version="1.0",
        sampling={"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 64},
        contract_fingerprint="0123456789abcdef",
        tool_calls=[
            ToolCall(
                turn=1,
                name="issue_refund",
                arguments={"order_id": "O-1", "amount": 0.1 + 0.2},
                raw="{...}",
                result={"refunded": 12.3, "nested": [1, None, "ü"]},
                latency_s=1e-9,
            ),
            ToolCall(
                turn=2,
                name=None,
                arguments=None,
                raw='{"name": ',
                error="malformed tool call: x",
                error_kind="malformed",
            ),
        ],
        final_answer="Refunded $12.30 — done ✓",
        finish_reason="answer",
        num_turns=2,
        reward=RewardBreakdown(
            task=1.0,
            tool=0.5,
            runtime=-0.25,
            format=1.0,
            success=True,
            violations=["v"],
            total=0.1 + 0.2 + 1.0,
            details={"diffs": [], "expected": 0.30000000000000004},
        ),
        timings={"tool_s": 0.1 + 0.2, "total_s": -1e-9},
        source="expert",
    )
    base.update(kw)
    return Trajectory(**base)


def test_jsonl_round_trip_is_lossless(tmp_path):
    trajs = [
        make_traj(0),
        make_traj(1, logprobs=[0.0, 0.0, 0.0] + AWKWARD_FLOATS[:6], reward=None),
        make_traj(2, tool_calls=[], segments=[], final_answer=None, finish_reason="max_tokens"),
    ]
    path = tmp_path / "t.jsonl"
    assert write_jsonl(path, trajs) == 3
    back = list(read_jsonl(path))
    assert [t.model_dump() for t in back] == [t.model_dump() for t in trajs]
    assert back == trajs
    # floats are bit-exact, including the sign of zero and subnormals
    for a, b in zip(trajs, back):
        assert [x.hex() for x in a.logprobs] == [x.hex() for x in b.logprobs]
        assert all(math.copysign(1, x) == math.copysign(1, y) for x, y in zip(a.logprobs, b.logprobs))
    assert back[0].logprobs[3] == 0.1 + 0.2 and back[0].logprobs[4] == -1e-9
    assert back[0].reward.total == 0.1 + 0.2 + 1.0
    assert back[0].tool_calls[0].arguments["amount"] == 0.30000000000000004
    assert back[0].tool_calls[1].ok is False and back[0].tool_calls[0].ok is True
    assert back[0].final_answer == "Refunded $12.30 — done ✓"


def test_jsonl_append_and_blank_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [make_traj(0)])
    write_jsonl(path, [make_traj(1)], append=True)
    with open(path, "a") as f:
        f.write("\n   \n")
    write_jsonl(path, [make_traj(2)], append=True)
    assert [t.id for t in read_jsonl(path)] == ["t-0", "t-1", "t-2"]
    write_jsonl(path, [make_traj(3)])  # overwrite
    assert [t.id for t in read_jsonl(path)] == ["t-3"]


def test_one_json_object_per_line(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [make_traj(0, final_answer="line one\nline two"), make_traj(1)])
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0])["final_answer"] == "line one\nline two"


@pytest.mark.parametrize(
    "field, value",
    [
        ("loss_mask", [0, 1]),
        ("logprobs", [0.0] * 10),
        ("token_ids", [1, 2, 3]),
    ],
)
def test_mismatched_lengths_raise(field, value):
    with pytest.raises(ValidationError, match="must have the same length"):
        make_traj(**{field: value})


def test_loss_mask_must_be_binary():
    with pytest.raises(ValidationError, match="only 0 and 1"):
        make_traj(loss_mask=[0, 0, 0, 2, 1, 0, 0, 1, 1])


def test_unknown_fields_and_bad_literals_rejected():
    with pytest.raises(ValidationError):
        make_traj(color="red")
    with pytest.raises(ValidationError):
        make_traj(finish_reason="tired")
    with pytest.raises(ValidationError):
        ToolCall(turn=1, name="x", arguments={}, raw="", error_kind="oops")


def test_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = make_traj(0).to_json()
    broken = json.loads(make_traj(1).to_json())
    broken["logprobs"] = broken["logprobs"][:-1]
    path.write_text(good + "\n\n" + json.dumps(broken) + "\n" + good + "\n", encoding="utf-8")
    it = read_jsonl(path)
    assert next(it).id == "t-0"
    with pytest.raises(ValueError) as exc:
        next(it)
    assert f"{path}:3:" in str(exc.value)
    assert "same length" in str(exc.value)


def test_garbage_line_names_file_and_line(tmp_path):
    path = tmp_path / "garbage.jsonl"
    path.write_text(make_traj(0).to_json() + "\n{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"garbage\.jsonl:2: not a valid Trajectory"):
        list(read_jsonl(path))


def test_properties():
    t = make_traj(0)
    assert t.num_policy_tokens == 4
    assert t.tool_success_rate == 0.5
    assert make_traj(1, tool_calls=[]).tool_success_rate == 1.0


def test_dumps_compact_format():
    assert dumps_compact({"a": 1, "b": [1, 2], "c": "ü"}) == '{"a": 1, "b": [1, 2], "c": "ü"}'

"""The sequence-level fallback of cross-tokenizer OPD: a trajectory written in the teacher's
tokens becomes an SFT target in the student's.

Each segment (prompt, policy turn, tool observation) is cut at the teacher's control tokens
and re-encoded as the student contract's *pieces* (:class:`~mentorrl.contract.ChatEncoder`),
never by re-encoding decoded text: a control token of the teacher's sequence becomes the
student's token of the same name, and the text between them is decoded with the teacher's
tokenizer and encoded as plain text. So content that spells ``<|im_end|>``,
``<|im_start|>system`` or ``<tool_call>`` (a user's message, a tool's output) stays text and
cannot forge a turn. Prompt and observation segments take only the template's control tokens
(``<|im_start|>``, ``<|im_end|>``); any other special token there is kept as its text. A policy
turn is the policy's own: its control tokens carry over, and tool-call tags in its text become
the tags (:func:`~mentorrl.contract.turn_pieces`, as for any turn written by someone else).

Roles, and therefore the loss mask, carry over segment by segment, so the student is trained
on the teacher's policy text only. The result carries the student's contract fingerprint and
zero behaviour log-probs (it is a demonstration, not a sample of the student). A trajectory
rendered by the teacher's contract re-tokenises to exactly the student contract's rendering
of the same episode.
"""

from __future__ import annotations

from typing import Any, Sequence

from mentorrl.contract import IM_END, IM_START, Control, RolloutContract, turn_pieces
from mentorrl.trajectory import Segment, Trajectory

TEMPLATE_CONTROLS = frozenset({IM_START, IM_END})  # the control tokens a prompt or observation segment holds


def control_names(tokenizer: Any) -> dict[int, str]:
    """Id -> name of every special token of ``tokenizer`` (its special tokens and special added tokens)."""
    names: dict[int, str] = {}
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            names[int(i)] = str(tok.content)
    for name in getattr(tokenizer, "all_special_tokens", None) or []:
        i = tokenizer.convert_tokens_to_ids(name)
        if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == name:
            names[i] = name
    return names


def segment_pieces(ids: Sequence[int], role: str, tokenizer: Any, controls: dict[int, str]) -> list[str]:
    """The pieces of one segment of ``tokenizer``'s ids (``controls``: :func:`control_names` of it)."""
    pieces: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            text = tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            pieces.extend(turn_pieces(text) if role == "policy" else [text])
            run.clear()

    for i in ids:
        name = controls.get(int(i))
        if name is None:
            run.append(int(i))
            continue
        flush()
        pieces.append(Control(name) if role == "policy" or name in TEMPLATE_CONTROLS else name)
    flush()
    return pieces


def retokenize(traj: Trajectory, src_tokenizer, dst: RolloutContract) -> Trajectory:
    ids: list[int] = []
    mask: list[int] = []
    segments: list[Segment] = []
    controls = control_names(src_tokenizer)
    for seg in traj.segments:
        pieces = segment_pieces(traj.token_ids[seg.start : seg.end], seg.role, src_tokenizer, controls)
        new = dst.encoder.pieces(pieces)
        segments.append(Segment(role=seg.role, start=len(ids), end=len(ids) + len(new)))
        ids += new
        mask += [1 if seg.role == "policy" else 0] * len(new)
    if not segments:
        raise ValueError(f"trajectory {traj.id} records no segments; it cannot be re-tokenised")
    return traj.model_copy(
        update={
            "id": f"{traj.id}-retok",
            "token_ids": ids,
            "loss_mask": mask,
            "logprobs": [0.0] * len(ids),
            "segments": segments,
            "contract_fingerprint": dst.fingerprint(),
            "source": "teacher",
            "sampling": dst.trajectory_sampling(),
        }
    )


__all__ = ["TEMPLATE_CONTROLS", "control_names", "retokenize", "segment_pieces"]

"""The sequence-level fallback of cross-tokenizer OPD: a trajectory written in the teacher's
tokens becomes an SFT target in the student's.

Each segment (prompt, policy turn, tool observation) is decoded to text with the teacher's
tokenizer and encoded again with the student's; roles, and therefore the loss mask, carry
over segment by segment, so the student is trained on the teacher's policy text only. The
result carries the student's contract fingerprint and zero behaviour log-probs (it is a
demonstration, not a sample of the student).
"""

from __future__ import annotations

from mentorrl.contract import RolloutContract
from mentorrl.trajectory import Segment, Trajectory


def retokenize(traj: Trajectory, src_tokenizer, dst: RolloutContract) -> Trajectory:
    ids: list[int] = []
    mask: list[int] = []
    segments: list[Segment] = []
    for seg in traj.segments:
        text = src_tokenizer.decode(traj.token_ids[seg.start: seg.end], clean_up_tokenization_spaces=False)
        new = dst.encode(text)
        segments.append(Segment(role=seg.role, start=len(ids), end=len(ids) + len(new)))
        ids += new
        mask += [1 if seg.role == "policy" else 0] * len(new)
    if not segments:
        raise ValueError(f"trajectory {traj.id} records no segments; it cannot be re-tokenised")
    return traj.model_copy(update={
        "id": f"{traj.id}-retok", "token_ids": ids, "loss_mask": mask, "logprobs": [0.0] * len(ids),
        "segments": segments, "contract_fingerprint": dst.fingerprint(), "source": "teacher",
        "sampling": {**dst.sampling_dict()},
    })


__all__ = ["retokenize"]

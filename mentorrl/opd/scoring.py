"""A teacher's signals over a batch of student trajectories, and a teacher loaded from its checkpoint: the
pieces the OPD stage runs in the learner's process and its teacher actors run under Ray
(:mod:`mentorrl.distributed.ray_teachers`), so both give the same numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from mentorrl.config import TeacherConfig
from mentorrl.models.build import load_policy
from mentorrl.opd.align import AlignmentError
from mentorrl.opd.signals import ChunkSignal, CrossTokenizerTeacher, same_tokenizer_signal
from mentorrl.opd.teacher import HFTeacher, TeacherSignal, tokenizer_fingerprint
from mentorrl.trajectory import Trajectory


def _signal(teacher, traj: Trajectory, top_k: int | None) -> tuple[ChunkSignal, TeacherSignal | None]:
    """The teacher's one forward pass over ``traj``: its chunk signal, and its top-k when asked for."""
    if isinstance(teacher, HFTeacher):
        scored = teacher.score(traj, top_k=top_k)
        return same_tokenizer_signal(teacher, traj, scored), (scored if top_k is not None else None)
    if top_k is None:
        return teacher.score(traj), None
    return teacher.score(traj, top_k=top_k)  # top-k on the chunks that are one token on both sides


def teacher_row(
    teacher, trajs: Sequence[Trajectory], top_k: int | None, skip_cross: bool = False
) -> list[tuple[ChunkSignal | None, TeacherSignal | None, bool]]:
    """``teacher``'s signals over ``trajs``: per trajectory ``(chunk signal, top-k or None, alignment failed)``.
    ``skip_cross``: a cross-tokenizer teacher gives none (``cross_tokenizer: sequence`` uses it otherwise).
    Run in this process, or on teacher actors (:mod:`mentorrl.distributed.ray_teachers`)."""
    if skip_cross and isinstance(teacher, CrossTokenizerTeacher):
        return [(None, None, False) for _ in trajs]
    row: list[tuple[ChunkSignal | None, TeacherSignal | None, bool]] = []
    for traj in trajs:
        try:
            sig, scored = _signal(teacher, traj, top_k)
            row.append((sig, scored, False))
        except AlignmentError:
            row.append((None, None, True))
    return row


def teacher_from_checkpoint(path: Path, student_tokenizer, t: TeacherConfig, placement=None):
    """An :class:`HFTeacher` when the checkpoint shares the student's tokenizer, else a
    :class:`CrossTokenizerTeacher`; loaded on ``placement`` (a :class:`mentorrl.models.device.Placement`;
    None: the CPU in fp32). Either returns its scores on the CPU, whatever its device."""
    tok, model = load_policy(path) if placement is None else load_policy(path, placement.dtype, placement.device)
    if tokenizer_fingerprint(tok) == tokenizer_fingerprint(student_tokenizer):
        return HFTeacher(model, tok, t.name, t.temperature)
    return CrossTokenizerTeacher(model, tok, student_tokenizer, t.name, t.temperature, t.special_tokens)

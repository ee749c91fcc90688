"""On-policy distillation pieces used by the OPD, black-box and evolve stages (``train/``).

* :mod:`~mentorrl.opd.teacher` -- the Teacher protocol, its capability ladder and local HF teachers;
* :mod:`~mentorrl.opd.align` / :mod:`~mentorrl.opd.retokenize` -- cross-tokenizer alignment;
* :mod:`~mentorrl.opd.advantage`, :mod:`~mentorrl.opd.mopd`, :mod:`~mentorrl.opd.rlsd`,
  :mod:`~mentorrl.opd.signals` -- distillation advantages, multi-teacher weights, RLSD, signal records;
* :mod:`~mentorrl.opd.remote_teacher` -- black-box (API-only) teachers over
  :mod:`mentorrl.clients.openai_api`.
"""

from mentorrl.opd.align import (
    AlignmentError,
    ChunkAlignment,
    align_texts,
    brute_force_chunk_logprobs,
    chunk_sums,
    teacher_token_logprobs,
    token_ends,
)
from mentorrl.opd.teacher import (
    Capability,
    HFTeacher,
    MissingCapability,
    Teacher,
    TeacherSignal,
    require,
    tokenizer_fingerprint,
)

__all__ = [
    "Capability",
    "HFTeacher",
    "MissingCapability",
    "Teacher",
    "TeacherSignal",
    "require",
    "tokenizer_fingerprint",
    "AlignmentError",
    "ChunkAlignment",
    "align_texts",
    "brute_force_chunk_logprobs",
    "chunk_sums",
    "teacher_token_logprobs",
    "token_ends",
]

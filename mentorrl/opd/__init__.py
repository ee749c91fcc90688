"""On-policy distillation: teachers, cross-tokenizer alignment (groundwork for white-box OPD)."""

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
    "Capability", "HFTeacher", "MissingCapability", "Teacher", "TeacherSignal", "require", "tokenizer_fingerprint",
    "AlignmentError", "ChunkAlignment", "align_texts", "brute_force_chunk_logprobs", "chunk_sums",
    "teacher_token_logprobs", "token_ends",
]

"""Compatibility names for callers outside :mod:`mentorrl.train` written before issue 18: the OPD
stage is :mod:`mentorrl.train.recipes.opd`, teacher building :mod:`mentorrl.train.teachers`."""

from mentorrl.train.recipes.opd import needed_capabilities, opd_stage
from mentorrl.train.teachers import build_teacher, load_teacher, teacher_dir, weights_fingerprint

__all__ = ["build_teacher", "load_teacher", "needed_capabilities", "opd_stage", "teacher_dir", "weights_fingerprint"]

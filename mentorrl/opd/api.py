"""Compatibility re-export: the OpenAI-compatible client moved to :mod:`mentorrl.clients.openai_api`.

Stays only while ``train/blackbox.py`` imports the old path; new code imports ``mentorrl.clients``.
"""

from mentorrl.clients.config import ClientConfig  # noqa: F401
from mentorrl.clients.openai_api import STAT_KEYS, ResponseCache, TeacherClient, scrub_secrets  # noqa: F401

__all__ = ["ClientConfig", "ResponseCache", "STAT_KEYS", "TeacherClient", "scrub_secrets"]

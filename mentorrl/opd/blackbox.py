"""Compatibility re-export: the remote (API-only) teachers moved to :mod:`mentorrl.opd.remote_teacher`,
so this name no longer twins ``train/blackbox.py`` (the stage).

Stays only while ``train/blackbox.py`` imports the old path.
"""

from mentorrl.opd.remote_teacher import *  # noqa: F401,F403
from mentorrl.opd.remote_teacher import __all__  # noqa: F401

"""Compatibility re-export: the trace facts moved to :mod:`mentorrl.core.trace` (rewards use them too).

Stays only while modules in ``train/`` still import the old path.
"""

from mentorrl.core.trace import *  # noqa: F401,F403

"""mentorrl: post-training for language-model agents."""

import os as _os

# OpenMP's default busy-waiting made 2-thread generation 5-50x slower whenever another process
# shared the cores (measured in issue 21, for mentorrl and TRL alike). This only takes effect when
# mentorrl is imported before torch (the `mentorrl` command always is); an explicit setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

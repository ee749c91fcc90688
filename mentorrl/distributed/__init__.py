"""Workers outside the learner's process: ``distributed.backend: ray`` (:mod:`mentorrl.distributed.ray_workers`).

Rollout workers are Ray actors, each with a copy of the policy and mentorrl's own rollout engine;
environments live in the workers or in separate environment actors. Nothing here imports ``ray``
at import time: the package is imported only when the config asks for the Ray backend
(``pip install "mentorrl[ray]"``).
"""

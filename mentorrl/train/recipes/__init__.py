"""The built-in training stages, one module each. The stage table (:data:`mentorrl.config.stages.BUILTIN_STAGES`)
names each stage's function by import path; :mod:`mentorrl.train.registry` imports a module when its stage runs."""

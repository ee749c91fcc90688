"""Core facts with no runtime dependencies (pure functions of the records in :mod:`mentorrl.trajectory`).

* :mod:`mentorrl.core.trace` -- facts about one trajectory's tool trace (call identity, loops,
  errors, claims of success), shared by rewards, metrics, review sampling and failure attribution.
* :mod:`mentorrl.core.checksums` -- checkpoint checksums (``checksums.sha256``), written last and
  verified before anything in a checkpoint is loaded.

The other core records stay top-level modules: :mod:`mentorrl.trajectory`,
:mod:`mentorrl.contract` and :mod:`mentorrl.chat`.
"""

"""The settings of the OpenAI-compatible client (declared with the run config in
:mod:`mentorrl.config.client`, re-exported here for the client)."""

from __future__ import annotations

from mentorrl.config.client import ClientConfig

__all__ = ["ClientConfig"]

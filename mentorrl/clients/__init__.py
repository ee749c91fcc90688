"""Clients of outside services, shared by the layers above (teachers, the LLM judge).

* :mod:`mentorrl.clients.openai_api` -- :class:`~mentorrl.clients.openai_api.TeacherClient`, the
  OpenAI chat-completions client (HTTP, ``httpx``): deadlines, retries, a response cache, secret
  scrubbing;
* :mod:`mentorrl.clients.config` -- its settings, :class:`~mentorrl.clients.config.ClientConfig`
  (pydantic only: the run config imports it).
"""

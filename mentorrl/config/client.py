"""The settings of the OpenAI-compatible client (:mod:`mentorrl.clients.openai_api`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ClientConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_url: str = Field("http://127.0.0.1:8000/v1", description="the server's /v1 root")
    model: str = Field("teacher", min_length=1, description="the model name sent with each request")
    api_key_env: str | None = Field("OPENAI_API_KEY", description="environment variable holding the key (null: none)")
    timeout_s: float = Field(30.0, gt=0, description="total deadline of one attempt, request sent to body read")
    max_retries: int = Field(4, ge=0, description="retries after the first attempt (timeouts, 429, 5xx)")
    backoff_s: float = Field(0.5, ge=0, description="first backoff; doubles each retry, with jitter")
    backoff_max_s: float = Field(8.0, ge=0, description="backoff cap (also caps Retry-After)")
    max_concurrency: int = Field(4, ge=1, description="requests in flight at once")
    max_response_bytes: int = Field(
        8 * 2**20,
        ge=1,
        description="largest response body accepted (decoded bytes); a longer one is cut off, counted and skipped",
    )
    cache_path: str | None = Field(None, description="SQLite response cache (null: no cache)")
    cache_namespace: str | None = Field(
        None,
        description="names the teacher in cache keys instead of base_url "
        "(a served checkpoint gets a new port each run)",
    )

"""``mentorrl serve MODEL_DIR``: the command that starts the :mod:`mentorrl.serve` server on a local policy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from mentorrl.models.gguf import is_gguf_source
from mentorrl.rollout.recorder import Recorder
from mentorrl.serve import (
    DEFAULT_BATCH_WINDOW_MS,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS_CAP,
    LOG_LEVELS,
    READY_PREFIX,
    base_url,
    bind_socket,
    create_app,
    is_loopback,
    run_server,
)
from mentorrl.serve.generation import DECODERS
from mentorrl.serve.recording import RecordingHook, RunSampling, add_recording_routes


def _set_threads(threads: int) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _checked_placement(device: str, dtype: str):
    """The served model's device and dtype, checked before anything loads (a clear exit 2 otherwise)."""
    from mentorrl.models.device import Placement, device_problem, dtype_problem

    problem = device_problem(device)
    if problem is None:
        try:
            placement = Placement.of(device, dtype)
        except ValueError as e:
            problem = str(e)
        else:
            problem = dtype_problem(dtype, placement.device, training=False)
    if problem is not None:
        raise fail(f"--device {device} --dtype {dtype}: {problem}")
    return placement


_MODEL_DIR = typer.Argument(
    ..., help="HF checkpoint directory (a ChatML tokenizer), or a .gguf file / short name (smollm2) to import"
)
_TOKEN_ENV = typer.Option(
    None, "--token-env", metavar="NAME", help="environment variable holding the bearer token required on /v1"
)
_MAX_BATCH = typer.Option(
    DEFAULT_MAX_BATCH,
    min=1,
    help="the most rows (the sum of the requests' n) decoded together; 1: one request at a time",
)
_BATCH_WINDOW_MS = typer.Option(DEFAULT_BATCH_WINDOW_MS, min=0.0, help="how long a batch waits for more requests")
_DECODER = typer.Option(
    "auto",
    help="what decodes a batch: slots (the rollouts' slot decoder), hf (the model's forward, a DynamicCache), "
    "hf_generate (model.generate), auto (slots where the model supports them, else hf_generate)",
)
_CONTINUOUS = typer.Option(
    True,
    "--continuous/--no-continuous",
    help="on the slot decoder: requests join the running decode loop between passes (continuous "
    "batching); --no-continuous decodes each batch to its end",
)
_RETAIN_ROWS = typer.Option(
    None,
    min=0,
    help="continuous batching: finished rows whose KV is kept for a later request continuing their "
    "context, e.g. an agent's next turn (default: --max-batch; 0: none)",
)
_DEVICE = typer.Option("auto", help="auto (the first CUDA device when there is one, else the CPU), cpu, cuda:N")
_RECORD = typer.Option(
    None,
    metavar="DB",
    help="recording mode: record every completion token in / token out into this SQLite file, "
    "grouped by the X-Mentorrl-Episode header (docs/bring-your-agent.md)",
)
_REWARD_KEY_ENV = typer.Option(
    None, metavar="NAME", help="with --record: the variable holding the key of POST /mentorrl/episodes/ID/reward"
)


def serve_command(
    model_dir: Path = _MODEL_DIR,
    host: str = typer.Option("127.0.0.1", help="address to bind; a non-loopback one needs --allow-remote"),
    port: int = typer.Option(8000, min=0, max=65535, help="0: any free port (read it from the ready line)"),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="allow binding a non-loopback address"),
    token_env: Optional[str] = _TOKEN_ENV,
    max_body_bytes: int = typer.Option(DEFAULT_MAX_BODY_BYTES, min=1, help="larger request bodies get 413"),
    max_tokens_cap: int = typer.Option(DEFAULT_MAX_TOKENS_CAP, min=1, help="the most tokens one reply may have"),
    max_batch: int = _MAX_BATCH,
    batch_window_ms: float = _BATCH_WINDOW_MS,
    decoder: str = _DECODER,
    continuous: bool = _CONTINUOUS,
    retain_rows: Optional[int] = _RETAIN_ROWS,
    threads: int = typer.Option(0, min=0, help="torch CPU threads (0: torch's default)"),
    device: str = _DEVICE,
    dtype: str = typer.Option("float32", help="the weights' dtype: float32, bfloat16 or float16"),
    model_name: Optional[str] = typer.Option(None, help="the model id clients see (default: the directory name)"),
    log_level: str = typer.Option("info", help="uvicorn log level (access logs at info)"),
    record: Optional[Path] = _RECORD,
    reward_key_env: Optional[str] = _REWARD_KEY_ENV,
    temperature: float = typer.Option(1.0, min=0.0, max=2.0, help="with --record: the sampling temperature"),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="with --record: the sampling top-p"),
) -> None:
    """Serve a policy over the OpenAI chat-completions protocol (POST /v1/chat/completions).

    Prints "mentorrl serve: listening on http://HOST:PORT/v1" on stdout when ready. With --record,
    every completion is recorded for training (an episode id header on every request, the sampling
    fixed by --temperature / --top-p, rewards posted with the reward key)."""
    from mentorrl.cli_common import quiet_transformers

    token, placement = _checked_token(host, allow_remote, token_env, log_level), _checked_placement(device, dtype)
    if not model_dir.is_dir() and not is_gguf_source(model_dir):  # a GGUF source is imported by load_policy
        raise fail(f"MODEL_DIR {model_dir} is not a directory (nor a .gguf file)")
    reward_key = _reward_key(record, reward_key_env)
    if decoder not in DECODERS:
        raise fail(f"--decoder must be one of {', '.join(DECODERS)}, not {decoder!r}")
    try:
        sock = bind_socket(host, port)
    except OSError as e:
        raise fail(f"cannot listen on {host}:{port}: {e}")
    quiet_transformers()
    _set_threads(threads)
    try:
        app = _serve_app(
            model_dir,
            placement,
            record,
            reward_key,
            RunSampling(temperature, top_p, max_tokens_cap),
            dict(
                model_name=model_name or model_dir.resolve().name,
                token=token,
                max_body_bytes=max_body_bytes,
                max_new_tokens_cap=max_tokens_cap,
                max_batch=max_batch,
                batch_window_ms=batch_window_ms,
                decoder=decoder,
                continuous=continuous,
                retain_rows=retain_rows,
            ),
        )
    except (OSError, ValueError) as e:
        sock.close()
        raise fail(f"cannot load a policy from {model_dir}: {e}")
    raise typer.Exit(run_server(app, sock, READY_PREFIX + base_url(sock), log_level))


def _serve_app(model_dir: Path, placement, record: Path | None, reward_key, sampling, options: dict):
    """The policy loaded and its app built (``options``: :func:`create_app`'s settings), with the recording
    routes under ``--record``."""
    from mentorrl.models.build import load_policy

    tokenizer, model = load_policy(model_dir, dtype=placement.dtype, device=placement.device)
    hook = None if record is None else _recording_hook(record, tokenizer, reward_key, sampling)
    app = create_app(tokenizer, model, recording=hook, **options)
    if hook is not None:
        add_recording_routes(app, hook)
    return app


def _checked_token(host: str, allow_remote: bool, token_env: str | None, log_level: str) -> str | None:
    """The bearer token of ``/v1`` (None: none), after the host and log-level checks."""
    from rich.markup import escape

    from mentorrl.cli_common import err

    if log_level not in LOG_LEVELS:
        raise fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
    if not is_loopback(host) and not allow_remote:
        raise fail(
            f"refusing to bind {host}: it is not a loopback address; pass --allow-remote to serve "
            "beyond this machine (and --token-env to require a token)"
        )
    token = None
    if token_env is not None:
        token = os.environ.get(token_env, "").strip()
        if not token:
            raise fail(f"--token-env {token_env}: the environment variable {token_env} is not set or empty")
    elif not is_loopback(host):
        err.print(
            f"[yellow]warning: serving on {escape(host)} without a token; anyone who can reach it can "
            "use the model (see --token-env)[/yellow]"
        )
    return token


def fail(message: str) -> typer.Exit:
    from rich.markup import escape

    from mentorrl.cli_common import err

    err.print(f"[red]{escape(message)}[/red]")
    return typer.Exit(2)


def _reward_key(record: Path | None, reward_key_env: str | None) -> str | None:
    if record is None:
        if reward_key_env is not None:
            raise fail("--reward-key-env needs --record")
        return None
    if reward_key_env is None:
        raise fail("--record needs --reward-key-env NAME: the key the harness posts rewards with")
    key = os.environ.get(reward_key_env, "").strip()
    if not key:
        raise fail(f"--reward-key-env {reward_key_env}: the environment variable {reward_key_env} is not set or empty")
    return key


def _recording_hook(db: Path, tokenizer, reward_key: str, sampling: RunSampling) -> RecordingHook:
    """A standalone server's recording: episodes are opened by their first request (``auto_open``)."""
    from mentorrl.serve import ChatRenderer

    close_id = tokenizer.convert_tokens_to_ids(ChatRenderer(tokenizer).stop_token)
    recorder = Recorder(
        db,
        close_id=close_id,
        stop_ids=[i for i in {close_id, tokenizer.eos_token_id} if i is not None],
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        auto_open=True,
    )
    return RecordingHook(recorder, reward_key, lambda: 0, sampling)


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command to ``app``."""
    app.command("serve")(serve_command)


__all__ = ["register", "serve_command"]

"""Trackers as users set them up (issue 40, item 4): each tracker's own environment (``WANDB_MODE``,
``MLFLOW_TRACKING_URI``, ``WANDB_PROJECT``, ``MLFLOW_EXPERIMENT_NAME``) and the ``logging`` section
decide where it writes and what the run is called, never overridden by a forced offline / local
store; the run's configuration goes to each tracker as hyperparameters with every secret redacted;
and a real ``mlflow server`` on 127.0.0.1 receives the run, its params and its stepped metrics."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from mentorrl.config import ConfigError, load_config
from mentorrl.train import trackers as T
from mentorrl.train.stage_checkpoints import metrics_log

SECRET = "sk-mentorrl-test-secret-7f3a9c"
USER_VARS = (
    "WANDB_MODE",
    "WANDB_PROJECT",
    "WANDB_NAME",
    "WANDB_TAGS",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "TRACKIO_DIR",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in USER_VARS:
        monkeypatch.delenv(var, raising=False)
    yield
    T.close_trackers()


def _stage_ws(run_dir: Path, overrides: list[str]):
    """What a stage hands the stage runner's ``metrics_log``: the config, the run dir and a console."""
    cfg = load_config(None, [f"run_dir={json.dumps(str(run_dir))}", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    ws = SimpleNamespace(cfg=cfg, run_dir=run_dir, console=Console(file=buf, width=200))
    ws.metrics = SimpleNamespace(path=run_dir / "metrics.jsonl")
    return ws, buf


def _drive(ws, stage: str, steps: int) -> list[dict]:
    """Log ``steps`` records the way the stage runner does (``metrics_log(ws).log`` once per step)."""
    recs = [
        {"stage": stage, "step": s, "loss": 1.0 / s, "reward_mean": 0.1 * s, "ok": True} for s in range(1, steps + 1)
    ]
    for r in recs:
        metrics_log(ws).log(r)
    return recs


# ------------------------------------------------------------- precedence -----
NAMES = st.none() | st.sampled_from(["from-config", "exp a"])
ENV_VALUES = st.none() | st.sampled_from(["from-env", "other"])


@given(
    project=NAMES,
    run_name=NAMES,
    mode=st.none() | st.sampled_from(["offline", "online", "disabled"]),
    uri=st.none() | st.just("http://127.0.0.1:1/cfg"),
    env_mode=st.none() | st.sampled_from(["online", "disabled", "offline"]),
    env_uri=st.none() | st.just("sqlite:///env.db"),
    env_project=ENV_VALUES,
    env_exp=ENV_VALUES,
    env_name=ENV_VALUES,
)
@settings(max_examples=150, deadline=None)
def test_settings_precedence(project, run_name, mode, uri, env_mode, env_uri, env_project, env_exp, env_name):
    """Where to send: the variable > the field > offline / local. What to call it: the field > the
    variable > ``mentorrl`` (and the run dir's name)."""
    cfg = SimpleNamespace(project=project, run_name=run_name, tags=[], wandb_mode=mode, mlflow_tracking_uri=uri)
    env = {
        k: v
        for k, v in {
            "WANDB_MODE": env_mode,
            "MLFLOW_TRACKING_URI": env_uri,
            "WANDB_PROJECT": env_project,
            "MLFLOW_EXPERIMENT_NAME": env_exp,
            "WANDB_NAME": env_name,
        }.items()
        if v is not None
    }
    s = T.resolve_settings(cfg, env)
    assert s.wandb_mode == (env_mode or mode or "offline")
    assert s.mlflow_uri == (env_uri or uri)  # None: the run's local SQLite store
    assert s.wandb_project == (project or env_project or T.PROJECT)
    assert s.mlflow_experiment == (project or env_exp or T.PROJECT)
    assert s.wandb_name == (run_name or env_name)
    assert s.run_name == run_name


def test_wandb_tags_and_legacy_modes():
    cfg = SimpleNamespace(tags=[], wandb_mode=None)
    s = T.resolve_settings(cfg, {"WANDB_TAGS": "a, b,,", "WANDB_MODE": "dryrun"})
    assert s.wandb_tags == ("a", "b") and s.wandb_mode == "offline"
    cfg.tags = ["mine"]
    assert T.resolve_settings(cfg, {"WANDB_TAGS": "a", "WANDB_MODE": "run"}).wandb_tags == ("mine",)
    assert T.resolve_settings(cfg, {"WANDB_MODE": "run"}).wandb_mode == "online"


def test_config_fields_validate():
    cfg = load_config(None, ["logging.project=p", "logging.run_name=r", "logging.tags=[a, k=v]"])
    assert (cfg.logging.project, cfg.logging.run_name, cfg.logging.tags) == ("p", "r", ["a", "k=v"])
    with pytest.raises(ConfigError, match="logging.wandb_mode"):
        load_config(None, ["logging.wandb_mode=sometimes"])
    with pytest.raises(ConfigError, match="logging.tags"):
        load_config(None, ["logging.tags=['  ']"])
    with pytest.raises(ConfigError, match="logging.log_every_steps"):
        load_config(None, ["logging.log_every_steps=0"])


# --------------------------------------------------------------- redaction -----
SECRET_NAMES = st.sampled_from(["api_key", "hf_token", "password", "db-secret", "auth", "OPENAI_APIKEY", "token"])
PLAIN_NAMES = st.sampled_from(["max_new_tokens", "tokenizer", "steps", "name", "keyboard", "lr", "monkey"])
LEAVES = st.integers(-5, 5) | st.booleans() | st.none() | st.text(max_size=8)


@st.composite
def configs(draw):
    """A nested config with secrets planted: under secret-looking names, inside plain strings (the
    value of a secret environment variable) and as a URL's password."""
    tree = draw(
        st.recursive(
            st.dictionaries(PLAIN_NAMES, LEAVES, max_size=3),
            lambda c: st.dictionaries(PLAIN_NAMES, c, max_size=3),
            max_leaves=12,
        )
    )
    node = tree
    for k in draw(st.lists(PLAIN_NAMES, max_size=3)):
        node = node.setdefault(k, {}) if isinstance(node.get(k, {}), dict) else node
    node[draw(SECRET_NAMES)] = SECRET + draw(st.text(max_size=3))
    node["base_url"] = f"https://user:{SECRET}@host.example/v1"
    node["note"] = draw(st.text(max_size=4)) + SECRET + draw(st.text(max_size=4))
    node["long"] = "x" * draw(st.integers(0, 2000))
    return tree


@given(configs())
@settings(max_examples=150, deadline=None)
def test_no_secret_reaches_the_params_and_every_param_is_bounded(cfg):
    params = T.config_params(cfg, env={"OPENAI_API_KEY": SECRET, "PATH": "/usr/bin"})
    flat = T.flat_params(params)
    text = json.dumps(params) + json.dumps(flat) + T._params_markdown(params)
    assert SECRET not in text and "sk-mentorrl" not in text
    assert all(len(k) <= T.MAX_PARAM_KEY and len(v) <= T.MAX_PARAM_VALUE for k, v in flat.items())
    assert all(isinstance(v, str) for v in flat.values())


def test_plain_fields_are_kept_and_flattened():
    cfg = load_config(None, ["grpo.steps=7", "sampling.max_new_tokens=33"])
    flat = T.flat_params(T.config_params(cfg, env={}))
    assert flat["grpo.steps"] == "7" and flat["sampling.max_new_tokens"] == "33"
    assert flat["model.tokenizer_corpus_tasks"] == str(cfg.model.tokenizer_corpus_tasks)
    assert flat["blackbox.teacher.client.api_key_env"] == T.REDACTED  # named like a key: redacted
    assert flat["logging.trackers"] == "[]"


# ---------------------------------------------------- the user's own settings -----
def test_wandb_mode_and_mlflow_uri_set_by_the_user_are_not_overridden(tmp_path, monkeypatch):
    """WANDB_MODE=disabled leaves no offline run; MLFLOW_TRACKING_URI puts the run in the user's store,
    not the run directory's."""
    store = tmp_path / "users-store.db"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "users-experiment")
    ws, buf = _stage_ws(tmp_path / "run", ["logging.trackers=[wandb, mlflow]", "logging.wandb_mode=offline"])
    _drive(ws, "grpo", 3)
    T.close_trackers()
    assert "warning" not in buf.getvalue(), buf.getvalue()
    assert not list((ws.run_dir / "trackers" / "wandb").glob("offline-run-*")), "W&B was forced offline"
    assert not (ws.run_dir / "trackers" / "mlflow.db").exists(), "MLflow was forced onto the local store"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    exp = client.get_experiment_by_name("users-experiment")
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.params["grpo.steps"] == str(ws.cfg.grpo.steps)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "grpo/loss")] == [1, 2, 3]


def test_defaults_are_offline_and_local(tmp_path):
    ws, buf = _stage_ws(
        tmp_path / "run", ["logging.trackers=[wandb, mlflow]", "logging.project=proj", "logging.run_name=r1"]
    )
    _drive(ws, "sft", 2)
    T.close_trackers()
    assert "warning" not in buf.getvalue(), buf.getvalue()
    assert list((ws.run_dir / "trackers" / "wandb").glob("offline-run-*"))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=T.mlflow_uri(ws.run_dir))
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "r1"


def test_hyperparameters_reach_every_tracker_without_the_secrets(tmp_path, monkeypatch):
    """The config (with a secret in a key-named field, in a URL and as an env var's value in a name)
    goes to TensorBoard's text summary, W&B's config, MLflow's params and trackio; the secret to none."""
    monkeypatch.setenv("MY_SERVICE_TOKEN", SECRET)
    ws, buf = _stage_ws(
        tmp_path / "run",
        [
            "logging.trackers=[tensorboard, wandb, mlflow, trackio]",
            f"blackbox.teacher.client.api_key_env={SECRET}",
            f"blackbox.teacher.client.base_url=https://me:{SECRET}@api.example/v1",
            f"logging.tags=[t-{SECRET}]",
            "grpo.steps=13",
        ],
    )
    _drive(ws, "grpo", 2)
    T.close_trackers()
    assert "warning" not in buf.getvalue(), buf.getvalue()
    for f in (ws.run_dir / "trackers").rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f"secret found in {f}"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(ws.run_dir / "trackers" / "tensorboard"))
    acc.Reload()
    (text,) = acc.Tensors("config/text_summary")
    assert "| grpo.steps | 13 |" in text.tensor_proto.string_val[0].decode()
    assert _wandb_config(ws.run_dir)["grpo"]["steps"] == 13


def _wandb_config(run_dir: Path) -> dict:
    """The config W&B recorded for the offline run (its ``config`` records, in order)."""
    from test_trackers import _wandb_records
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict = {}
    for f in sorted((run_dir / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")):
        for raw in _wandb_records(str(f)):
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "config":
                out.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    return {k: v.get("value", v) if isinstance(v, dict) else v for k, v in out.items()}


# ------------------------------------------------------ a real MLflow server -----
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """``mlflow server`` on 127.0.0.1 (a free port, its own SQLite store), up once /health answers."""
    exe = shutil.which("mlflow", path=os.path.dirname(sys.executable)) or shutil.which("mlflow")
    assert exe, "the mlflow package's `mlflow` command is missing (pip install -e '.[test]')"
    port = _free_port()
    log = (tmp_path / "mlflow-server.log").open("wb")
    cmd = [exe, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    cmd += [
        "--backend-store-uri",
        f"sqlite:///{tmp_path / 'server.db'}",
        "--default-artifact-root",
        str(tmp_path / "art"),
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "mlflow-server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not come up in 180 s"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its workers (its own session)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.mark.slow  # the server takes 20-50 s to start on a loaded 2-core machine
def test_a_run_logs_to_a_real_mlflow_server(tmp_path, monkeypatch, mlflow_server):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    ws, buf = _stage_ws(
        tmp_path / "run",
        [
            "logging.trackers=[mlflow]",
            "logging.project=server-exp",
            "logging.run_name=tiny",
            "logging.tags=[team=rl, baseline]",
            "grpo.steps=5",
            f"blackbox.teacher.client.api_key_env={SECRET}",
        ],
    )
    recs = _drive(ws, "sft", 2) + _drive(ws, "grpo", 3)
    T.close_trackers()
    assert "warning" not in buf.getvalue(), buf.getvalue()
    assert not (ws.run_dir / "trackers" / "mlflow.db").exists()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("server-exp")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    assert run.data.tags["team"] == "rl" and run.data.tags["baseline"] == ""
    params = run.data.params
    want = T.flat_params(T.config_params(ws.cfg))
    assert params == want  # every field of the config, flattened, bounded
    assert params["grpo.steps"] == "5" and params["logging.project"] == "server-exp"
    assert SECRET not in json.dumps(params) and params["blackbox.teacher.client.api_key_env"] == T.REDACTED
    for stage, n in (("sft", 2), ("grpo", 3)):
        for key in ("loss", "reward_mean", "ok"):
            hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"{stage}/{key}"))
            got = [(r["step"], float(r[key])) for r in recs if r["stage"] == stage]
            assert [st for st, _ in hist] == [st for st, _ in got] == list(range(1, n + 1))
            assert [v for _, v in hist] == pytest.approx([v for _, v in got])

    # resumed in a new process (the same run), with one field changed: no step twice, the change kept as a tag
    ws2, _ = _stage_ws(ws.run_dir, ["logging.trackers=[mlflow]", "logging.project=server-exp", "grpo.steps=9"])
    metrics_log(ws2).log({"stage": "grpo", "step": 3, "loss": 9.0})  # already sent: skipped
    metrics_log(ws2).log({"stage": "grpo", "step": 4, "loss": 0.25})
    T.close_trackers()
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.params["grpo.steps"] == "5" and run.data.tags["mentorrl.resumed.grpo.steps"] == "9"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "grpo/loss")][-2:] == [
        (3, pytest.approx(1 / 3)),
        (4, 0.25),
    ]

"""Trackers (``logging.trackers``): each of TensorBoard, W&B (offline), MLflow (local store) and
trackio (local) receives the same step metrics as ``metrics.jsonl``, read back from its own files;
a resumed run sends no step twice; a tracker that fails to import or to log is warned about once and
training goes on; nothing goes over the network and no secret reaches a tracker's files.

The four packages are in the ``[test]`` extra; a missing one fails these tests (never a skip)."""

from __future__ import annotations

import copy
import glob
import importlib
import io
import json
import socket
import struct
import warnings
from pathlib import Path

import pytest
import torch
from rich.console import Console

from mentorrl.config import ConfigError, OptimConfig, load_config
from mentorrl.train import trackers as T
from mentorrl.train.learner import Learner
from mentorrl.train.loop import run_stage
from mentorrl.train.rundir import MetricsLog
from mentorrl.train.workspace import Workspace

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
SECRET = "sk-mentorrl-test-secret-7f3a9c"
USER_VARS = ("WANDB_MODE", "WANDB_PROJECT", "WANDB_NAME", "WANDB_TAGS", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")
TIMING = {"step_s", "cpu_s", "cpu_util", "cpu_cores", "update_s"}


def _require(name: str) -> None:
    try:
        importlib.import_module(PACKAGES[name])
    except Exception as e:  # a clear failure, never a silent skip
        pytest.fail(
            f"tracker {name!r} needs the {PACKAGES[name]!r} package ({type(e).__name__}: {e}); "
            f"install the test extra: pip install -e '.[test]'"
        )


# ------------------------------------------------------------ reading back -----
def _wandb_records(path: str):
    """The records of a ``.wandb`` file (W&B's LevelDB-style log: 7-byte header, 32 KiB blocks,
    each record a 7-byte header (crc32c, length, type) and a protobuf ``Record``)."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and n == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk
            buf = b""


def _prefixed(rows: list[dict[str, float]]) -> list[tuple[str, int, dict[str, float]]]:
    """``{"<stage>/step": s, "<stage>/k": v}`` rows (W&B, trackio) as (stage, step, {k: v})."""
    out = []
    for row in rows:
        steps = [k for k in row if k.endswith("/step")]
        assert len(steps) == 1, row
        stage = steps[0][: -len("/step")]
        out.append(
            (
                stage,
                int(row[steps[0]]),
                {k.split("/", 1)[1]: float(v) for k, v in row.items() if k.startswith(stage + "/") and k != steps[0]},
            )
        )
    return out


def read_back(run_dir: Path, name: str) -> list[tuple[str, int, dict[str, float]]]:
    """Every (stage, step, metrics) a tracker holds, from its own local files, in logged order."""
    root = run_dir / "trackers"
    if name == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(root / "tensorboard"), size_guidance={"scalars": 0})
        acc.Reload()
        rows: dict[tuple[str, int], dict[str, float]] = {}
        seen: dict[tuple[str, int], int] = {}
        for tag in acc.Tags()["scalars"]:
            stage, key = tag.split("/", 1)
            for ev in acc.Scalars(tag):
                seen[(tag, ev.step)] = seen.get((tag, ev.step), 0) + 1
                rows.setdefault((stage, ev.step), {})[key] = ev.value
        dup = [k for k, n in seen.items() if n > 1]
        assert not dup, f"tensorboard holds a step twice: {dup}"
        return [(s, st, m) for (s, st), m in sorted(rows.items())]
    if name == "wandb":
        from wandb.proto import wandb_internal_pb2 as pb

        out = []
        for f in sorted(glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))):
            for raw in _wandb_records(f):
                rec = pb.Record()
                rec.ParseFromString(raw)
                if rec.WhichOneof("record_type") == "history":
                    row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                    out.append({k: v for k, v in row.items() if not k.startswith("_")})
        return _prefixed(out)
    if name == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=T.mlflow_uri(run_dir))
        run_id = json.loads((root / T.STATE_FILE).read_text())["mlflow_run_id"]
        rows = {}
        for key in client.get_run(run_id).data.metrics:
            stage, k = key.split("/", 1)
            for m in client.get_metric_history(run_id, key):
                assert k not in rows.get((stage, m.step), {}), f"mlflow holds {key} step {m.step} twice"
                rows.setdefault((stage, m.step), {})[k] = m.value
        return [(s, st, m) for (s, st), m in sorted(rows.items())]
    if name == "trackio":
        T._point_trackio_at((root / "trackio").resolve())
        from trackio.sqlite_storage import SQLiteStorage

        run = json.loads((root / T.STATE_FILE).read_text())["name"]
        logs = SQLiteStorage.get_logs(T.PROJECT, run)
        return _prefixed([{k: v for k, v in r.items() if k not in ("timestamp", "step")} for r in logs])
    raise ValueError(name)


def _expected(records: list[dict]) -> list[tuple[str, int, dict[str, float]]]:
    return [(r["stage"], r["step"], T.scalar_metrics(r)) for r in records]


def _assert_same(got, want, name: str, skip_keys: set[str] = frozenset(), skip_steps=()) -> None:
    got_steps = [(s, st) for s, st, _ in got]
    assert sorted(got_steps) == sorted((s, st) for s, st, _ in want), f"{name}: steps differ"
    assert len(set(got_steps)) == len(got_steps), f"{name}: a step was logged twice"
    by = {(s, st): m for s, st, m in got}
    for s, st, m in want:
        keys = set(m) - (skip_keys if (s, st) in skip_steps else set())
        assert set(by[(s, st)]) >= keys, f"{name}: {s} step {st} lacks {keys - set(by[(s, st)])}"
        for k in keys:  # tensorboard stores float32
            assert by[(s, st)][k] == pytest.approx(m[k], rel=1e-6, abs=1e-6), f"{name}: {s}/{k} at step {st}"


@pytest.fixture
def no_network(monkeypatch):
    """Refuse (and record) any socket connection that leaves the machine."""
    attempts: list[object] = []
    real = socket.socket.connect

    def connect(self, address):
        local = self.family == getattr(socket, "AF_UNIX", None) or (
            isinstance(address, tuple) and str(address[0]) in ("127.0.0.1", "::1", "localhost")
        )
        if not local:
            attempts.append(address)
            raise OSError(f"test: network access refused ({address})")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempts


@pytest.fixture(autouse=True)
def _close_trackers():
    yield
    T.close_trackers()


# ------------------------------------------------------------------ tests -----
def test_config_section():
    assert load_config(None, []).logging.trackers == []
    cfg = load_config(None, ["logging.trackers=[tensorboard, wandb, mlflow, trackio]"])
    assert cfg.logging.trackers == ["tensorboard", "wandb", "mlflow", "trackio"]
    with pytest.raises(ConfigError, match="logging.trackers"):
        load_config(None, ["logging.trackers=[neptune]"])
    with pytest.raises(ConfigError, match="logging.trackers"):
        load_config(None, ["logging.trackers=[wandb, wandb]"])


def test_scalar_metrics_keeps_finite_numbers_only():
    rec = {
        "stage": "grpo",
        "step": 3,
        "loss": 0.5,
        "n": 4,
        "flag": True,
        "bad": float("nan"),
        "inf": float("inf"),
        "hist": {"0": 2},
        "name": "x",
        "xs": [1, 2],
    }
    assert T.scalar_metrics(rec) == {"loss": 0.5, "n": 4.0, "flag": 1.0}


@pytest.fixture
def workspace(tmp_path, tokenizer, orders_entry, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)  # a secret in the environment must reach no tracker
    for var in USER_VARS:  # the defaults: what the user's own shell set must not leak into this test
        monkeypatch.delenv(var, raising=False)
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "logging.trackers=[tensorboard, wandb, mlflow, trackio]"])
    buf = io.StringIO()
    ws = Workspace(
        cfg=cfg,
        run_dir=tmp_path / "run",
        env_entry=orders_entry,
        tokenizer=tokenizer,
        console=Console(file=buf, width=200),
        show_progress=False,
    )
    ws.run_dir.mkdir(parents=True)
    return ws, buf


class Interrupt(Exception):
    pass


def _stage(ws, model, stage, steps, checkpoint_every, resume, crash_at=None):
    learner = Learner(model, OptimConfig(lr=1e-3), pad_id=0)
    param = next(model.parameters())

    def step_fn(step: int) -> dict:
        if crash_at is not None and step == crash_at:
            raise Interrupt
        with torch.no_grad():
            param.add_(1.0)
        return {
            "loss": float(step) / 3,
            "w": float(param.detach().flatten()[1]),
            "reward_mean": 0.25 * step,
            "ok": True,
            "note": "text stays in metrics.jsonl",
            "nan": float("nan"),
        }

    return run_stage(ws, stage, model, learner, steps, step_fn, checkpoint_every, resume)


def test_each_tracker_receives_the_same_metrics_and_resume_sends_no_step_twice(workspace, model, no_network):
    for name in T.TRACKERS:
        _require(name)
    ws, buf = workspace
    _stage(ws, copy.deepcopy(model), "sft", steps=3, checkpoint_every=3, resume=False)
    with pytest.raises(Interrupt):  # grpo steps 1-3 logged, the step-2 checkpoint kept, then a crash
        _stage(ws, copy.deepcopy(model), "grpo", steps=5, checkpoint_every=2, resume=False, crash_at=3)
    T.close_trackers()  # the process died: a new one resumes
    _stage(ws, copy.deepcopy(model), "grpo", steps=5, checkpoint_every=2, resume=True)
    T.close_trackers()

    records = ws.metrics.read()
    assert [(r["stage"], r["step"]) for r in records] == [("sft", 1), ("sft", 2), ("sft", 3)] + [
        ("grpo", s) for s in range(1, 6)
    ]
    want = _expected(records)
    for name in T.TRACKERS:
        # grpo step 3 was redone after the resume: the tracker kept the first pass (same numbers, own timings)
        _assert_same(read_back(ws.run_dir, name), want, name, skip_keys=TIMING, skip_steps={("grpo", 3)})
    assert "warning" not in buf.getvalue(), buf.getvalue()
    assert no_network == [], f"a tracker tried the network: {no_network}"
    for f in (ws.run_dir / "trackers").rglob("*"):  # no secret in any tracker file
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f"secret found in {f}"
    assert list((ws.run_dir / "trackers" / "wandb").glob("offline-run-*")), "wandb did not run offline"


def test_fresh_run_sends_a_stage_again(workspace, model):
    _require("tensorboard")
    ws, _ = workspace
    ws.cfg = ws.cfg.model_copy(update={"logging": ws.cfg.logging.model_copy(update={"trackers": ["tensorboard"]})})
    _stage(ws, copy.deepcopy(model), "grpo", steps=2, checkpoint_every=2, resume=False)
    state = json.loads((ws.run_dir / "trackers" / T.STATE_FILE).read_text())
    assert state["logged"] == {"tensorboard": {"grpo": 2}}
    T.close_trackers()
    _stage(ws, copy.deepcopy(model), "grpo", steps=3, checkpoint_every=2, resume=False)
    state = json.loads((ws.run_dir / "trackers" / T.STATE_FILE).read_text())
    assert state["logged"] == {"tensorboard": {"grpo": 3}}  # started over: sent again from step 1


class _Boom:
    name = "boom"

    def __init__(self, root, state, settings=None):
        self.calls = 0

    def log(self, stage, step, metrics):
        self.calls += 1
        if step == 2:
            raise RuntimeError("disk full")

    def close(self):
        pass


class _Good:
    name = "good"
    got: list = []

    def __init__(self, root, state, settings=None):
        pass

    def log(self, stage, step, metrics):
        _Good.got.append((stage, step, metrics))

    def close(self):
        pass


def _missing(root, state, settings=None):
    raise ImportError("No module named 'wandb'")


def test_a_failing_tracker_warns_once_and_training_goes_on(tmp_path):
    _Good.got = []
    backends = {"tensorboard": _missing, "wandb": _Boom, "mlflow": _Good}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts = T.TrackerSet(tmp_path, ["tensorboard", "wandb", "mlflow"], backends=backends)
        log = MetricsLog(tmp_path / "metrics.jsonl", trackers=ts)
        for step in range(1, 5):
            log.log({"stage": "grpo", "step": step, "loss": step / 10})
    msgs = [str(w.message) for w in caught if issubclass(w.category, T.TrackerWarning)]
    assert len(msgs) == 2, msgs  # one per failing tracker, however many steps follow
    assert "'tensorboard' could not start (ImportError: No module named 'wandb')" in msgs[0]
    assert "'wandb' failed to log grpo step 2 (RuntimeError: disk full)" in msgs[1]
    assert all("training goes on" in m for m in msgs)
    assert ts.names == ["mlflow"] and set(ts.dropped) == {"tensorboard", "wandb"}
    assert [r["step"] for r in log.read()] == [1, 2, 3, 4]  # metrics.jsonl has every step
    assert [g[1] for g in _Good.got] == [1, 2, 3, 4]


def test_a_tracker_whose_package_is_missing_is_dropped_with_a_warning(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.warns(T.TrackerWarning, match="'tensorboard' could not start"):
        ts = T.TrackerSet(tmp_path, ["tensorboard"])
    ts.log({"stage": "sft", "step": 1, "loss": 1.0})
    assert ts.names == []


def test_tracker_calls_do_not_move_the_rngs(tmp_path):
    import random

    class Noisy(_Good):
        def log(self, stage, step, metrics):
            random.random()
            torch.rand(3)

    ts = T.TrackerSet(tmp_path, ["tensorboard"], backends={"tensorboard": Noisy})
    random.seed(1)
    torch.manual_seed(1)
    ts.log({"stage": "sft", "step": 1, "loss": 1.0})
    a, b = random.random(), torch.rand(1)
    random.seed(1)
    torch.manual_seed(1)
    assert (a, b) == (random.random(), torch.rand(1))

"""Trackers: every step metric also goes to TensorBoard, W&B, MLflow or trackio (``logging.trackers``).

They are fed from the one place step metrics are written, :meth:`mentorrl.train.rundir.MetricsLog.log`
(called by the stage runner once per step, on rank 0), so a tracker sees exactly the records of
``metrics.jsonl``: each numeric, finite value of a record as ``<stage>/<metric>`` at the stage's
step (booleans as 0/1; strings, lists, dicts and non-finite numbers stay in ``metrics.jsonl`` only).

Everything is local, under ``RUN_DIR/trackers/``, and nothing is sent over the network:

* ``tensorboard``: event files in ``trackers/tensorboard/`` (``tensorboard --logdir RUN_DIR/trackers/tensorboard``);
* ``wandb``: an offline run in ``trackers/wandb/`` (``wandb sync`` uploads it later, if the user wants);
  stages share one run, each with its own step axis (``<stage>/step``);
* ``mlflow``: a local SQLite store, ``trackers/mlflow.db`` (``mlflow ui --backend-store-uri sqlite:///...``;
  MLflow 3 refuses its old ``./mlruns`` file store unless told otherwise, and the SQLite file is the
  local store it recommends), artifacts in ``trackers/mlflow-artifacts/``;
* ``trackio``: its SQLite store in ``trackers/trackio/`` (``TRACKIO_DIR``; ``trackio show``).

Only step metrics are sent: never the config, the environment, the console or system information
(W&B's console capture, system stats, git and code saving are off), so no secret reaches a tracker.

A tracker that fails to import, to open or to log is reported once through ``warn`` and dropped; the
run goes on with the others and ``metrics.jsonl``. Tracker calls never move the Python or torch RNG
(their state is restored around each call), so a run with trackers gives the same numbers.

Resume: ``trackers/state.json`` keeps the run identity (the W&B id, the MLflow run id) and, per
tracker and stage, the last step it received. A resumed run redoes the steps after its checkpoint
(``metrics.jsonl`` is cut back to it); a tracker is never sent a step it already has, so no step is
duplicated (the values it kept are those of the first pass, which a resumed run reproduces, timings
aside). A stage started over without ``--resume`` is sent again from its first step.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import random
import sys
import time
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
TRACKERS_DIR = "trackers"
STATE_FILE = "state.json"
PROJECT = "mentorrl"


class TrackerWarning(RuntimeWarning):
    """A tracker could not be imported, opened or written to; it was dropped and training went on."""


def scalar_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The values of a ``metrics.jsonl`` record that trackers receive: finite numbers (bools as 0/1),
    without ``stage`` and ``step``."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if k in ("stage", "step") or not isinstance(v, (int, float)):
            continue
        v = float(v)
        if math.isfinite(v):
            out[k] = v
    return out


@contextmanager
def _rng_kept() -> Iterator[None]:
    """Restore the Python, torch and (when loaded) numpy RNG states after a tracker call."""
    py = random.getstate()
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    t_state = torch.get_rng_state() if torch is not None else None
    n_state = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        random.setstate(py)
        if t_state is not None:
            torch.set_rng_state(t_state)
        if n_state is not None:
            np.random.set_state(n_state)


# ------------------------------------------------------------------ backends -----
class _TensorBoard:
    name = "tensorboard"

    def __init__(self, root: Path, state: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(root / "tensorboard"))

    def log(self, stage: str, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"{stage}/{k}", v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    name = "wandb"

    def __init__(self, root: Path, state: dict[str, Any]):
        import wandb

        settings = wandb.Settings(
            mode="offline",
            console="off",
            x_disable_stats=True,
            x_disable_meta=True,
            save_code=False,
            disable_git=True,
            silent=True,
        )
        self.run = wandb.init(
            project=PROJECT,
            name=state["name"],
            id=state["id"],
            dir=str(root),
            mode="offline",
            resume="allow",
            reinit="create_new",
            settings=settings,
        )
        self.stages: set[str] = set()

    def log(self, stage: str, step: int, metrics: dict[str, float]) -> None:
        if stage not in self.stages:  # each stage's metrics are plotted against its own step
            self.run.define_metric(f"{stage}/step")
            self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
            self.stages.add(stage)
        self.run.log({f"{stage}/step": step, **{f"{stage}/{k}": v for k, v in metrics.items()}})

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    name = "mlflow"

    def __init__(self, root: Path, state: dict[str, Any]):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=mlflow_uri(root.parent))
        exp = self.client.get_experiment_by_name(PROJECT)
        exp_id = (
            exp.experiment_id
            if exp is not None
            else self.client.create_experiment(
                PROJECT, artifact_location=(root / "mlflow-artifacts").resolve().as_uri()
            )
        )
        run_id = state.get("mlflow_run_id")
        if run_id is None:
            run_id = self.client.create_run(exp_id, run_name=state["name"]).info.run_id
            state["mlflow_run_id"] = run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, stage: str, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(f"{stage}/{k}", v, ts, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _point_trackio_at(directory: Path) -> None:
    """trackio reads ``TRACKIO_DIR`` once, at import; set it first, or move an already-imported trackio."""
    os.environ["TRACKIO_DIR"] = str(directory)
    for name, mod in list(sys.modules.items()):
        if name == "trackio" or name.startswith("trackio."):
            if hasattr(mod, "TRACKIO_DIR"):
                mod.TRACKIO_DIR = directory
            if hasattr(mod, "MEDIA_DIR"):
                mod.MEDIA_DIR = directory / "media"


class _Trackio:
    name = "trackio"

    def __init__(self, root: Path, state: dict[str, Any]):
        directory = (root / "trackio").resolve()
        _point_trackio_at(directory)
        import trackio

        _point_trackio_at(directory)
        self.trackio = trackio
        self.run = trackio.init(
            project=PROJECT, name=state["name"], resume="allow", embed=False, auto_log_cpu=False, auto_log_gpu=False
        )

    def log(self, stage: str, step: int, metrics: dict[str, float]) -> None:
        self.run.log({f"{stage}/step": step, **{f"{stage}/{k}": v for k, v in metrics.items()}})

    def close(self) -> None:
        self.run.finish()


BACKENDS: dict[str, Callable[[Path, dict[str, Any]], Any]] = {
    "tensorboard": _TensorBoard,
    "wandb": _Wandb,
    "mlflow": _Mlflow,
    "trackio": _Trackio,
}


def mlflow_uri(run_dir: str | Path) -> str:
    """The MLflow tracking URI of a run's local store."""
    return "sqlite:///" + str((Path(run_dir) / TRACKERS_DIR / "mlflow.db").resolve())


# ------------------------------------------------------------------ the set -----
def _default_warn(msg: str) -> None:
    warnings.warn(msg, TrackerWarning, stacklevel=3)


class TrackerSet:
    """The trackers of one run directory; :meth:`log` takes ``metrics.jsonl`` records."""

    def __init__(
        self,
        run_dir: str | Path,
        names: list[str] | tuple[str, ...],
        warn: Callable[[str], None] | None = None,
        backends: dict[str, Callable[[Path, dict[str, Any]], Any]] | None = None,
    ):
        unknown = [n for n in names if n not in TRACKERS]
        if unknown:
            raise ValueError(f"unknown tracker(s) {unknown}; known: {', '.join(TRACKERS)}")
        self.root = Path(run_dir) / TRACKERS_DIR
        self.root.mkdir(parents=True, exist_ok=True)
        self.warn = warn or _default_warn
        self.state = self._read_state()
        self.state.setdefault("name", Path(run_dir).resolve().name or "run")
        self.state.setdefault("id", uuid.uuid4().hex[:12])  # os.urandom: no RNG call of the run
        self.state.setdefault("logged", {})
        self.live: dict[str, Any] = {}
        self.dropped: dict[str, str] = {}
        backends = backends or BACKENDS
        for name in names:
            try:
                with _rng_kept():
                    self.live[name] = backends[name](self.root, self.state)
            except Exception as e:  # ImportError, a broken install, a store that does not open
                self._drop(name, f"could not start ({type(e).__name__}: {e})")
        self._write_state()

    def _read_state(self) -> dict[str, Any]:
        try:
            return json.loads((self.root / STATE_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def _write_state(self) -> None:
        tmp = self.root / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=1), encoding="utf-8")
        os.replace(tmp, self.root / STATE_FILE)

    def _drop(self, name: str, why: str) -> None:
        self.dropped[name] = why
        tracker = self.live.pop(name, None)
        self.warn(
            f"tracker {name!r} {why}; it is dropped for the rest of this run, training goes on "
            f"(metrics.jsonl has every step)"
        )
        if tracker is not None:
            try:
                with _rng_kept():
                    tracker.close()
            except Exception:
                pass

    @property
    def names(self) -> list[str]:
        return list(self.live)

    def log(self, record: dict[str, Any]) -> None:
        stage, step = str(record.get("stage", "?")), int(record.get("step", 0))
        metrics = scalar_metrics(record)
        changed = False
        for name, tracker in list(self.live.items()):
            done = self.state["logged"].setdefault(name, {})
            if step <= done.get(stage, 0):
                continue  # a step redone after a resume: this tracker has it already
            try:
                with _rng_kept():
                    tracker.log(stage, step, metrics)
            except Exception as e:
                self._drop(name, f"failed to log {stage} step {step} ({type(e).__name__}: {e})")
                continue
            done[stage] = step
            changed = True
        if changed:
            self._write_state()

    def restart(self, stage: str) -> None:
        """``stage`` starts over (not a resume): every tracker is sent its steps again from the first."""
        for done in self.state["logged"].values():
            done.pop(stage, None)
        self._write_state()

    def close(self) -> None:
        for name, tracker in list(self.live.items()):
            try:
                with _rng_kept():
                    tracker.close()
            except Exception as e:
                self.warn(f"tracker {name!r} failed to close ({type(e).__name__}: {e})")
        self.live.clear()


_OPEN: dict[tuple[str, tuple[str, ...]], TrackerSet] = {}


def open_trackers(
    run_dir: str | Path, names: list[str] | tuple[str, ...], warn: Callable[[str], None] | None = None
) -> TrackerSet | None:
    """The run directory's :class:`TrackerSet` (opened once per process, closed at exit or by
    :func:`close_trackers`); None when no tracker is configured."""
    if not names:
        return None
    key = (str(Path(run_dir).resolve()), tuple(names))
    if key not in _OPEN:
        _OPEN[key] = TrackerSet(run_dir, names, warn)
        atexit.register(close_trackers, run_dir)  # after the trackers' own exit hooks were registered: runs first
    return _OPEN[key]


def close_trackers(run_dir: str | Path | None = None) -> None:
    """Close the open tracker sets (of ``run_dir`` only, when given), flushing what they hold."""
    want = str(Path(run_dir).resolve()) if run_dir is not None else None
    for key in [k for k in _OPEN if want is None or k[0] == want]:
        _OPEN.pop(key).close()

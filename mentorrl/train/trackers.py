"""Trackers: every step metric also goes to TensorBoard, W&B, MLflow or trackio (``logging.trackers``).

They are fed from the one place step metrics are written, :meth:`mentorrl.train.rundir.MetricsLog.log`
(called by the stage runner once per step, on rank 0), so a tracker sees exactly the records of
``metrics.jsonl``: each numeric, finite value of a record as ``<stage>/<metric>`` at the stage's
step (booleans as 0/1; strings, lists, dicts and non-finite numbers stay in ``metrics.jsonl`` only).
The run's configuration goes once per process as hyperparameters (:func:`config_params`): W&B's
config, MLflow params (flattened dotted keys, bounded lengths), a TensorBoard text summary, trackio's
config; every field whose name looks like a key, token, secret or password, every value that holds a
secret environment variable's value and the credentials of a URL are redacted first.

Where they write (:func:`resolve_settings`; docs/trackers.md has the table). Where a tracker sends
follows its environment first, then the ``logging`` section, then the local default:

* ``tensorboard``: event files in ``trackers/tensorboard/`` (``tensorboard --logdir RUN_DIR/trackers/tensorboard``);
* ``wandb``: ``WANDB_MODE``, else ``logging.wandb_mode``, else offline in ``trackers/wandb/``
  (``wandb sync`` uploads it later); stages share one run, each with its own step axis (``<stage>/step``);
* ``mlflow``: ``MLFLOW_TRACKING_URI``, else ``logging.mlflow_tracking_uri``, else a local SQLite store,
  ``trackers/mlflow.db`` (MLflow 3 refuses its old ``./mlruns`` file store unless told otherwise),
  artifacts in ``trackers/mlflow-artifacts/``;
* ``trackio``: its SQLite store in ``trackers/trackio/`` (``TRACKIO_DIR`` when the user set it; ``trackio show``).

What the run is called (``logging.project``, ``run_name``, ``tags``) wins over the trackers' own
variables (``WANDB_PROJECT``, ``MLFLOW_EXPERIMENT_NAME``, ``WANDB_NAME``), as an argument of the
tracker's own init does; unset, those variables are used, then ``mentorrl`` and the run directory's name.

Never sent: the environment, the console or system information (W&B's console capture, system
stats, git and code saving are off).

A tracker that fails to import, to open or to log is reported once through ``warn`` and dropped; the
run goes on with the others and ``metrics.jsonl``. Tracker calls never move the Python or torch RNG
(their state is restored around each call), so a run with trackers gives the same numbers.

Resume: ``trackers/state.json`` keeps the run identity (the W&B id, the MLflow run id and its tracking
URI) and, per tracker and stage, the last step it received. A resumed run redoes the steps after its
checkpoint (``metrics.jsonl`` is cut back to it); a tracker is never sent a step it already has, so no
step is duplicated (the values it kept are those of the first pass, which a resumed run reproduces,
timings aside). A stage started over without ``--resume`` is sent again from its first step.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import random
import re
import sys
import time
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
TRACKERS_DIR = "trackers"
STATE_FILE = "state.json"
PROJECT = "mentorrl"
REDACTED = "<redacted>"
MAX_PARAM_KEY = 250  # MLflow's limit on a param key
MAX_PARAM_VALUE = 500  # well under MLflow's 6000; a longer value is cut and marked
MLFLOW_BATCH = 100  # params per MLflow log_batch call (its limit)
_SECRET_WORDS = frozenset(
    {"key", "apikey", "token", "secret", "password", "passwd", "pwd", "credential", "credentials", "auth"}
)
# WANDB_MODE as wandb reads it (its legacy spellings too); passed explicitly, since wandb reads its
# environment once per process, at its first setup
_WANDB_MODES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline", "disabled": "disabled"}
_SECRET_WORDS_RE = re.compile(r"[^a-z0-9]+")
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]+@")


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


# ------------------------------------------------------------ settings -----
@dataclass(frozen=True)
class TrackerSettings:
    """Where each tracker writes and what the run is called there, resolved once per run
    (:func:`resolve_settings`), and the hyperparameters it is given (:func:`config_params`)."""

    project: str | None = None  # logging.project (null: each tracker's own variable, then PROJECT)
    run_name: str | None = None  # logging.run_name (null: WANDB_NAME for W&B, then the run dir's name)
    tags: tuple[str, ...] = ()
    wandb_mode: str = "offline"
    wandb_tags: tuple[str, ...] = ()
    mlflow_uri: str | None = None  # None: the run's local SQLite store
    mlflow_experiment: str = PROJECT
    wandb_project: str = PROJECT
    wandb_name: str | None = None
    params: dict[str, Any] = field(default_factory=dict)  # the redacted configuration, nested


def resolve_settings(logging_cfg: Any = None, env: Mapping[str, str] | None = None, params=None) -> TrackerSettings:
    """The trackers' settings from the ``logging`` section and the environment.

    Where to send: ``WANDB_MODE`` > ``logging.wandb_mode`` > offline; ``MLFLOW_TRACKING_URI`` >
    ``logging.mlflow_tracking_uri`` > the local store. What to call it: ``logging.project`` >
    ``WANDB_PROJECT`` / ``MLFLOW_EXPERIMENT_NAME`` > ``mentorrl``; ``logging.run_name`` > ``WANDB_NAME``
    (W&B) > the run directory's name."""
    env = os.environ if env is None else env
    secrets = secret_values(env)
    get = lambda name: redact(getattr(logging_cfg, name, None), secrets)  # noqa: E731  (a name holds no secret)
    project = get("project")
    return TrackerSettings(
        project=project,
        run_name=get("run_name"),
        tags=tuple(get("tags") or ()),
        wandb_mode=_WANDB_MODES.get(env.get("WANDB_MODE", "").strip().lower(), None) or get("wandb_mode") or "offline",
        wandb_tags=tuple(get("tags") or ())
        or tuple(t.strip() for t in env.get("WANDB_TAGS", "").split(",") if t.strip()),
        mlflow_uri=env.get("MLFLOW_TRACKING_URI") or getattr(logging_cfg, "mlflow_tracking_uri", None) or None,
        mlflow_experiment=project or env.get("MLFLOW_EXPERIMENT_NAME") or PROJECT,
        wandb_project=project or env.get("WANDB_PROJECT") or PROJECT,
        wandb_name=get("run_name") or env.get("WANDB_NAME") or None,
        params=dict(params or {}),
    )


def _secret_name(name: str) -> bool:
    """A field or variable name that looks like it holds a credential (``api_key``, ``hf_token``,
    ``db_password``; not ``max_new_tokens`` or ``tokenizer``)."""
    words = [w for w in _SECRET_WORDS_RE.split(name.lower()) if w]
    return any(w in _SECRET_WORDS for w in words) or name.lower().endswith(("apikey", "api_key"))


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """The values of the environment variables whose names look secret (8 characters or more)."""
    env = os.environ if env is None else env
    return sorted({v for k, v in env.items() if _secret_name(k) and len(v) >= 8}, key=len, reverse=True)


def redact(value: Any, secrets: list[str], name: str = "") -> Any:
    """``value`` (a JSON-like config) with the values of secret-looking fields replaced by
    ``<redacted>``, every occurrence of a ``secrets`` value cut out of strings, and the user:password
    part of URLs removed."""
    if name and _secret_name(name) and value not in (None, "", [], {}):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, secrets, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets) for v in value]
    if isinstance(value, str):
        for s in secrets:
            value = value.replace(s, REDACTED)
        return _URL_USERINFO.sub(r"\1" + REDACTED + "@", value)
    return value


def config_params(cfg: Any, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A run config (a pydantic model or a dict) as the hyperparameters trackers are given: JSON values,
    secrets redacted (:func:`redact`)."""
    data = cfg.model_dump(mode="json") if hasattr(cfg, "model_dump") else dict(cfg)
    return redact(data, secret_values(env))


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def flat_params(params: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested hyperparameters as MLflow params: dotted keys (sections and dicts flattened; lists,
    numbers, booleans and null as JSON), keys at most 250 and values at most 500 characters."""
    out: dict[str, str] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, key + "."))
            continue
        text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)
        out[_bounded(key, MAX_PARAM_KEY)] = _bounded(text, MAX_PARAM_VALUE)
    return out


def _params_markdown(params: dict[str, Any]) -> str:
    """The flattened hyperparameters as a Markdown table (TensorBoard's text summary)."""
    esc = lambda t: t.replace("|", "\\|").replace("\n", " ")  # noqa: E731
    rows = [f"| {esc(k)} | {esc(v)} |" for k, v in flat_params(params).items()]
    return "\n".join(["| field | value |", "|---|---|", *rows])


def _mlflow_tags(tags: tuple[str, ...]) -> dict[str, str]:
    """``key=value`` tags as MLflow key/value tags; a bare tag gets an empty value."""
    return {t.split("=", 1)[0].strip(): (t.split("=", 1)[1].strip() if "=" in t else "") for t in tags}


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

    def __init__(self, root: Path, state: dict[str, Any], settings: TrackerSettings):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(root / "tensorboard"))
        if settings.params:  # hparams as a text summary (add_hparams would open a second run directory)
            self.writer.add_text("config", _params_markdown(settings.params), 0)
            self.writer.flush()

    def log(self, stage: str, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"{stage}/{k}", v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    name = "wandb"

    def __init__(self, root: Path, state: dict[str, Any], settings: TrackerSettings):
        import wandb

        mode = {"mode": settings.wandb_mode}
        wb_settings = wandb.Settings(
            console="off",
            x_disable_stats=True,
            x_disable_meta=True,
            save_code=False,
            disable_git=True,
            silent=True,
            **mode,
        )
        self.run = wandb.init(
            project=settings.wandb_project,
            name=settings.wandb_name or state["name"],
            id=state["id"],
            dir=str(root),
            tags=list(settings.wandb_tags) or None,
            config=settings.params or None,
            resume="allow",
            reinit="create_new",
            settings=wb_settings,
            **mode,
        )
        if settings.params:  # a resumed run may have changed a field (more steps)
            self.run.config.update(settings.params, allow_val_change=True)
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

    def __init__(self, root: Path, state: dict[str, Any], settings: TrackerSettings):
        from mlflow.tracking import MlflowClient

        uri = settings.mlflow_uri or mlflow_uri(root.parent)
        self.client = MlflowClient(tracking_uri=uri)
        run_id = state.get("mlflow_run_id") if state.get("mlflow_tracking_uri", uri) == uri else None
        if run_id is None:  # a new run, or another tracking server than the one the run started on
            state.get("logged", {}).pop(self.name, None)
            run_id = self._create_run(root, state, settings)
            state["mlflow_run_id"], state["mlflow_tracking_uri"] = run_id, uri
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self._log_params(flat_params(settings.params))

    def _create_run(self, root: Path, state: dict[str, Any], settings: TrackerSettings) -> str:
        name = settings.mlflow_experiment
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            exp_id = exp.experiment_id
        elif settings.mlflow_uri is None:  # the local store keeps its artifacts beside it
            exp_id = self.client.create_experiment(
                name, artifact_location=(root / "mlflow-artifacts").resolve().as_uri()
            )
        else:  # a server puts artifacts where it is configured to
            exp_id = self.client.create_experiment(name)
        tags = _mlflow_tags(settings.tags)
        return self.client.create_run(exp_id, run_name=settings.run_name or state["name"], tags=tags).info.run_id

    def _log_params(self, params: dict[str, str]) -> None:
        """MLflow params cannot change: on a resume only new ones are logged; a changed value goes to
        the tag ``mentorrl.resumed.<key>`` (the first value stays the param)."""
        from mlflow.entities import Param, RunTag

        have = self.client.get_run(self.run_id).data.params
        new = [Param(k, v) for k, v in params.items() if k not in have]
        changed = [
            RunTag(_bounded(f"mentorrl.resumed.{k}", MAX_PARAM_KEY), v)
            for k, v in params.items()
            if have.get(k, v) != v
        ]
        for i in range(0, len(new), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=new[i : i + MLFLOW_BATCH])
        for i in range(0, len(changed), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, tags=changed[i : i + MLFLOW_BATCH])

    def log(self, stage: str, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(f"{stage}/{k}", v, ts, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow's limit of metrics per call
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _trackio_dir(root: Path) -> Path:
    """``TRACKIO_DIR`` when the user set it, else the run's ``trackers/trackio/``."""
    user = os.environ.get("TRACKIO_DIR")
    if user and user not in OPEN_TRACKERS.trackio_dirs:
        return Path(user)
    return (root / "trackio").resolve()


def _point_trackio_at(directory: Path) -> None:
    """trackio reads ``TRACKIO_DIR`` once, at import; set it first, or move an already-imported trackio."""
    os.environ["TRACKIO_DIR"] = str(directory)
    OPEN_TRACKERS.trackio_dirs.add(str(directory))
    for name, mod in list(sys.modules.items()):
        if name == "trackio" or name.startswith("trackio."):
            if hasattr(mod, "TRACKIO_DIR"):
                mod.TRACKIO_DIR = directory
            if hasattr(mod, "MEDIA_DIR"):
                mod.MEDIA_DIR = directory / "media"


class _Trackio:
    name = "trackio"

    def __init__(self, root: Path, state: dict[str, Any], settings: TrackerSettings):
        directory = _trackio_dir(root)
        _point_trackio_at(directory)
        import trackio

        _point_trackio_at(directory)
        self.trackio = trackio
        self.run = trackio.init(
            project=settings.project or PROJECT,
            name=settings.run_name or state["name"],
            config=flat_params(settings.params) or None,
            resume="allow",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    def log(self, stage: str, step: int, metrics: dict[str, float]) -> None:
        self.run.log({f"{stage}/step": step, **{f"{stage}/{k}": v for k, v in metrics.items()}})

    def close(self) -> None:
        self.run.finish()


Backend = Callable[[Path, dict[str, Any], TrackerSettings], Any]
BACKENDS: dict[str, Backend] = {
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
        backends: dict[str, Backend] | None = None,
        settings: TrackerSettings | None = None,
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
        self.settings = settings or resolve_settings()
        for name in names:
            try:
                with _rng_kept():
                    self.live[name] = backends[name](self.root, self.state, self.settings)
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


class OpenTrackers:
    """The tracker sets open in this process, one per run directory and tracker list: opened by
    :meth:`open` (once), closed by :meth:`close` or at exit; and the ``TRACKIO_DIR`` values set for
    them (so not the user's). One instance, :data:`OPEN_TRACKERS`."""

    def __init__(self) -> None:
        self.sets: dict[tuple[str, tuple[str, ...]], TrackerSet] = {}
        self.trackio_dirs: set[str] = set()

    def open(
        self,
        run_dir: str | Path,
        names: list[str] | tuple[str, ...],
        warn: Callable[[str], None] | None = None,
        settings: Callable[[], TrackerSettings] | TrackerSettings | None = None,
    ) -> TrackerSet:
        key = (str(Path(run_dir).resolve()), tuple(names))
        if key not in self.sets:
            made = settings() if callable(settings) else settings
            self.sets[key] = TrackerSet(run_dir, names, warn, settings=made)
            atexit.register(self.close, run_dir)  # after the trackers' own exit hooks were registered: runs first
        return self.sets[key]

    def close(self, run_dir: str | Path | None = None) -> None:
        want = str(Path(run_dir).resolve()) if run_dir is not None else None
        for key in [k for k in self.sets if want is None or k[0] == want]:
            self.sets.pop(key).close()


OPEN_TRACKERS = OpenTrackers()


def open_trackers(
    run_dir: str | Path,
    names: list[str] | tuple[str, ...],
    warn: Callable[[str], None] | None = None,
    settings: Callable[[], TrackerSettings] | TrackerSettings | None = None,
) -> TrackerSet | None:
    """The run directory's :class:`TrackerSet` (opened once per process, closed at exit or by
    :func:`close_trackers`); None when no tracker is configured. ``settings`` (or a function making
    them, called only when the set is opened): see :func:`resolve_settings`."""
    if not names:
        return None
    return OPEN_TRACKERS.open(run_dir, names, warn, settings)


def close_trackers(run_dir: str | Path | None = None) -> None:
    """Close the open tracker sets (of ``run_dir`` only, when given), flushing what they hold."""
    OPEN_TRACKERS.close(run_dir)

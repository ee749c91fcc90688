"""Where models run and in what precision: the config's device and dtype names resolved to torch's.

Config fields (schema only, strings): ``model.device`` / ``model.dtype`` (the learner),
``rollout.device`` / ``rollout.dtype`` (the rollout engine) and ``opd.teachers[i].device`` /
``.dtype`` (a teacher); null in the last two means "as the learner". Every place that loads or places a
model resolves them here:

* :func:`resolve_device` -- ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> :class:`torch.device`
  (``auto``: the first CUDA device when there is one, else the CPU);
* :func:`resolve_dtype` -- ``float32`` | ``bfloat16`` | ``float16`` -> :class:`torch.dtype`;
* :func:`device_problem` / :func:`dtype_problem` -- why a setting cannot be used on this machine
  (None when it can), for the preflight, which names the field;
* :func:`autocast` -- the learner's mixed-precision context: fp32 weights and optimizer state, the
  forward under ``torch.autocast`` in the compute dtype (nothing for float32).
"""

from __future__ import annotations

import functools
import os
import re
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """``spec`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``; None: ``auto``) as a device. ``auto`` is
    ``cuda:LOCAL_RANK`` (``cuda:0`` outside torchrun) when CUDA is available, else ``cpu``; plain ``cuda`` is ``cuda:0``. Raises
    ValueError for a name outside that list or a CUDA device this machine does not have."""
    if isinstance(spec, torch.device):
        return spec
    name = (spec or "auto").strip().lower()
    if not _DEVICE.match(name):
        raise ValueError(f"device {spec!r}: expected auto, cpu, cuda or cuda:N")
    if name == "auto":  # under torchrun, each rank its own GPU (LOCAL_RANK)
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if name == "cpu":
        return torch.device("cpu")
    index = int(name.split(":")[1]) if ":" in name else 0
    if not torch.cuda.is_available():
        raise ValueError(f"device {spec!r}: CUDA is not available on this machine (torch {torch.__version__})")
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def resolve_dtype(name: str | torch.dtype | None = "float32", device: torch.device | None = None) -> torch.dtype:
    """``float32`` | ``bfloat16`` | ``float16`` (None: float32) as a torch dtype; ``auto``: the choice of
    :func:`choose_dtype` for ``device`` (None: ``auto``'s device)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return choose_dtype(device if device is not None else resolve_device("auto")).dtype
    try:
        return DTYPES[name or "float32"]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected one of {', '.join(DTYPES)}") from None


AUTO_BF16_MIN_SPEEDUP = 1.5  # dtype auto takes bfloat16 on a CPU whose bf16 matmul is at least this much faster


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``dtype: auto`` chose on a device, and why (printed at start, written to the run directory)."""

    device: str
    dtype: torch.dtype
    reason: str
    bf16_speedup: float | None = None  # measured bf16 / fp32 matmul rate (CPU only)

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": str(self.dtype).removeprefix("torch."), "reason": self.reason,
                "bf16_speedup": self.bf16_speedup}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrecisionChoice:
        """The inverse of :meth:`to_dict` (``RUN_DIR/precision.json``); ValueError on anything else."""
        try:
            dtype = DTYPES[d["dtype"]]
            speedup = d.get("bf16_speedup")
            return cls(str(d["device"]), dtype, str(d["reason"]), None if speedup is None else float(speedup))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a precision choice: {d!r}") from e


class PinnedChoices:
    """The run's recorded :class:`PrecisionChoice` per device in this process (see :func:`pin_choice`)."""

    def __init__(self) -> None:
        self._by_device: dict[str, PrecisionChoice] = {}

    def pin(self, choice: PrecisionChoice) -> None:
        self._by_device[choice.device] = choice

    def get(self, device: str) -> PrecisionChoice | None:
        return self._by_device.get(device)

    def clear(self) -> None:
        self._by_device.clear()


_PINNED = PinnedChoices()


def pin_choice(choice: PrecisionChoice) -> None:
    """Make ``dtype: auto`` on ``choice.device`` resolve to ``choice`` in this process, without a probe:
    the run's choice, made once (by rank 0) and recorded, so every rank, and a resumed run, computes in
    the dtype the run started with, however busy the machine is when they measure."""
    _PINNED.pin(choice)


def matmul_rate(dtype: torch.dtype, device: torch.device, n: int = 384, min_s: float = 0.05) -> float:
    """Measured GFLOP/s of an ``n``-square matmul in ``dtype`` on ``device`` (after one warm-up)."""
    import time

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while True:
        a @ b
        reps += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_s and reps >= 3:
            return 2 * n**3 * reps / elapsed / 1e9


def choose_dtype(device: torch.device) -> PrecisionChoice:
    """``dtype: auto`` on ``device``, decided once per device and process: a GPU with bfloat16 takes it (else
    float32); a CPU takes bfloat16 when a start-up probe measures its bf16 matmul at least
    :data:`AUTO_BF16_MIN_SPEEDUP` times the fp32 rate (CPUs with AMX / AVX512-BF16 units: ~6x on this project's
    machines; without them bf16 runs far slower), else float32. A choice pinned by :func:`pin_choice` (the
    run's) comes first: the probe is a timing, and near the threshold two probes may disagree."""
    pinned = _PINNED.get(str(device))
    return pinned if pinned is not None else _choose_dtype(str(device))


@functools.lru_cache(maxsize=8)
def _choose_dtype(name: str) -> PrecisionChoice:
    device = torch.device(name)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return PrecisionChoice(name, torch.bfloat16, "the GPU supports bfloat16")
        return PrecisionChoice(name, torch.float32, "the GPU has no bfloat16")
    ratio = matmul_rate(torch.bfloat16, device) / matmul_rate(torch.float32, device)
    pick = torch.bfloat16 if ratio >= AUTO_BF16_MIN_SPEEDUP else torch.float32
    why = f"bf16 matmul measured at {ratio:.1f}x fp32 on this CPU (bf16 from {AUTO_BF16_MIN_SPEEDUP}x)"
    return PrecisionChoice(name, pick, why, round(ratio, 2))


def device_problem(spec: str | None) -> str | None:
    """Why device ``spec`` cannot be used here (None: it can)."""
    try:
        resolve_device(spec)
    except ValueError as e:
        return str(e)
    return None


def dtype_problem(name: str | None, device: torch.device, training: bool) -> str | None:
    """Why dtype ``name`` cannot be used on ``device`` (None: it can). bfloat16 needs a GPU that has it;
    float16 training on the CPU is refused: the CPU's float16 matmuls are slow and its autocast
    brings no speed or memory gain there (use bfloat16), and float16 inference on the CPU is allowed."""
    dtype = resolve_dtype(name, device)
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return f"dtype bfloat16: {torch.cuda.get_device_name(device)} has no bfloat16 support (use float16)"
    if device.type == "cpu" and dtype == torch.float16 and training:
        return "dtype float16 on the CPU: no faster and less exact than bfloat16 there; use bfloat16 or float32"
    return None


@dataclass(frozen=True)
class Placement:
    """A model's device and dtype (for the learner, ``dtype`` is its compute dtype; weights stay fp32)."""

    device: torch.device
    dtype: torch.dtype

    @classmethod
    def of(cls, device: str | None, dtype: str | None, like: "Placement | None" = None) -> "Placement":
        """Resolved from config names; a None name takes ``like``'s value (the learner's), else the default."""
        dev = resolve_device(device) if device is not None or like is None else like.device
        dt = resolve_dtype(dtype, dev) if dtype is not None or like is None else like.dtype
        return cls(dev, dt)

    def matches(self, model) -> bool:
        """Whether ``model``'s parameters are already on this device in this dtype."""
        p = next(model.parameters(), None)
        return p is None or (same_device(p.device, self.device) and p.dtype == self.dtype)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Equal devices, ``cuda`` and ``cuda:<current>`` counting as one."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    cur = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)


def learner_placement(cfg: Any) -> Placement:
    """The learner's device and compute dtype (``model.device`` / ``model.dtype`` of a run config)."""
    return Placement.of(cfg.model.device, cfg.model.dtype)


def rollout_placement(cfg: Any) -> Placement:
    """The rollout engine's device and dtype (``rollout.device`` / ``rollout.dtype``; null: the learner's)."""
    r = cfg.rollout
    return Placement.of(r.device, r.dtype, like=learner_placement(cfg))


def rollout_backend_args(cfg: Any) -> tuple[Any, Placement]:
    """``(rollout section, placement)`` for :class:`mentorrl.rollout.BackendChoice`: the section with its
    dtype filled in (null: ``model.dtype``, which the vLLM engine is built with) and the hf backend's placement."""
    place = rollout_placement(cfg)
    dtype = cfg.rollout.dtype or cfg.model.dtype
    if dtype == "auto":  # the engine gets the name the probe chose
        dtype = str(place.dtype).removeprefix("torch.")
    return cfg.rollout.model_copy(update={"dtype": dtype}), place


def teacher_placement(cfg: Any, teacher: Any) -> Placement:
    """A teacher's device and dtype (its ``device`` / ``dtype``; null: the learner's)."""
    return Placement.of(getattr(teacher, "device", None), getattr(teacher, "dtype", None), like=learner_placement(cfg))


def placement_problems(cfg: Any) -> list[tuple[str, str]]:
    """``(field, why)`` for every device / dtype setting of run config ``cfg`` this machine cannot honour."""
    out: list[tuple[str, str]] = []
    fields = [
        ("model", cfg.model.device, cfg.model.dtype, True),
        ("rollout", cfg.rollout.device, cfg.rollout.dtype, False),
    ]
    opd = getattr(cfg, "opd", None)
    for i, t in enumerate(getattr(opd, "teachers", None) or []):
        fields.append((f"opd.teachers[{i}]", getattr(t, "device", None), getattr(t, "dtype", None), False))
    learner = None
    for name, dev, dt, training in fields:
        why = device_problem(dev) if dev is not None else None
        if why is not None:
            out.append((f"{name}.device", why))
            continue
        if learner is None and not training:  # the learner's own device was the problem: nothing to inherit
            continue
        place = Placement.of(dev, dt, like=learner)
        why = dtype_problem(dt, place.device, training) if dt is not None else None
        if why is not None:
            out.append((f"{name}.dtype", why))
        if training:
            learner = place
    return out


def autocast(device: torch.device, dtype: torch.dtype) -> ContextManager:
    """The mixed-precision context of a learner forward: ``torch.autocast`` in ``dtype`` (bf16 / fp16)
    on ``device``'s type; nothing for float32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(device: torch.device, dtype: torch.dtype):
    """A ``torch.amp.GradScaler`` for float16 training on a GPU (float16 gradients underflow without
    one); None otherwise (float32, bfloat16, or the CPU)."""
    if dtype != torch.float16 or device.type != "cuda":
        return None
    return torch.amp.GradScaler(device.type)


def module_placement(model) -> Placement:
    """The device and dtype of ``model``'s first parameter (CPU float32 for a model without any)."""
    p = next(model.parameters(), None)
    return Placement(torch.device("cpu"), torch.float32) if p is None else Placement(p.device, p.dtype)


__all__ = [
    "DTYPES",
    "Placement",
    "autocast",
    "device_problem",
    "dtype_problem",
    "grad_scaler",
    "learner_placement",
    "module_placement",
    "placement_problems",
    "resolve_device",
    "resolve_dtype",
    "rollout_backend_args",
    "rollout_placement",
    "same_device",
    "teacher_placement",
]

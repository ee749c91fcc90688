"""Local teachers: built once per build recipe (a longer SFT of a tiny model, or of a copy of the
student) into a shared directory keyed by that recipe, and loaded as a same-tokenizer
:class:`~mentorrl.opd.teacher.HFTeacher` or a :class:`~mentorrl.opd.signals.CrossTokenizerTeacher`.
Used by the OPD stage and by the black-box stage's served teacher."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import torch
from rich.markup import escape

from mentorrl.config import OptimConfig, SFTConfig, TeacherConfig
from mentorrl.models.build import load_policy
from mentorrl.models.device import teacher_placement
from mentorrl.models.gguf import GGUFImportError, resolve_model_path
from mentorrl.opd.scoring import teacher_from_checkpoint
from mentorrl.train.models_init import build_tiny_model
from mentorrl.train.rundir import CorruptCheckpointError, require_manifest
from mentorrl.train.workspace import Workspace, open_workspace

TEACHER_RECIPE_FIELDS = ("seed", "train_split", "env", "sampling", "limits", "prompt", "reward", "model", "sft")


def teacher_build_config(cfg, t: TeacherConfig):
    """The run config that builds teacher ``t``: this run's environment, contract and seed, the
    teacher's own model size (and tokenizer when ``build.vocab_size`` is set), and a longer SFT
    on more expert demonstrations than the student's (of ``build.families`` only, when set: a specialist)
    -- the demo's ``sft`` stage with other numbers."""
    b = t.build
    spec = (b.spec or cfg.model.spec).model_copy(update={"vocab_size": b.vocab_size or cfg.model.spec.vocab_size})
    sft = SFTConfig(
        num_demos=b.num_demos,
        families=sorted(b.families) if b.families else None,  # one cache key for one set of families
        steps=b.sft_steps,
        batch_size=b.batch_size,
        optim=OptimConfig(lr=b.lr, warmup_steps=5),
    )
    keep = {
        k: getattr(cfg, k) for k in ("seed", "train_split", "threads", "env", "sampling", "limits", "prompt", "reward")
    }
    return type(cfg)(recipe=["sft"], model=cfg.model.model_copy(update={"path": None, "spec": spec}), sft=sft, **keep)


def weights_fingerprint(model) -> str:
    """A hash of a model's weights (names, shapes, dtypes and values): the cache key of a teacher
    built from it."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())  # reshape: 0-dim tensors (a logit scale) too
    return h.hexdigest()


def teacher_dir(cfg, t: TeacherConfig, student_weights: str | None = None) -> Path:
    """Where teacher ``t`` is built: one directory per build recipe under ``opd.teachers_dir`` (shared by
    every run that asks for the same teacher), or under the run directory when that is null. A teacher
    built from the student (``build.init: student``) is keyed by the student's weights as well."""
    sub = teacher_build_config(cfg, t).model_dump(mode="json", include=set(TEACHER_RECIPE_FIELDS))
    if sub["sft"].get("families") is None:  # every family: the key of the teachers built before the filter existed
        sub["sft"].pop("families", None)
    if t.build.init == "student":
        if student_weights is None:
            raise ValueError(
                f"teacher {t.name!r} is built from the student (build.init student): its directory "
                "depends on the student's weights"
            )
        sub = {**sub, "init": "student", "student_weights": student_weights}
    key = hashlib.sha256(json.dumps(sub, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(cfg.opd.teachers_dir) if cfg.opd.teachers_dir else Path(cfg.run_dir) / "teachers"
    return root / f"{t.name}-{key}"


def build_teacher(ws: Workspace, t: TeacherConfig, student=None) -> Path:
    """The stronger local teacher, built once (resumable: the SFT stage checkpoints like any other).

    ``build.init: scratch`` trains a fresh tiny model; ``student`` trains on from a copy of
    ``student`` (the policy as it enters the stage), so the teacher is the student trained longer."""
    from mentorrl.train.registry import get_stage, resolve_runner

    sft_stage = resolve_runner(get_stage("sft"))

    from_student = t.build.init == "student"
    if from_student and student is None:
        raise ValueError(f"teacher {t.name!r} has build.init student but no student model was given")
    out = teacher_dir(ws.cfg, t, weights_fingerprint(student) if from_student else None)
    final = out / "sft" / "final"
    if (final / "DONE").exists() and cached_build_intact(ws, t, final):  # load_teacher still checks the tokenizer
        return final
    if not from_student and ws.cfg.model.path is not None and t.build.vocab_size is None:
        raise ValueError(
            f"teacher {t.name!r}: the student is a checkpoint ({ws.cfg.model.path}) and no teacher of "
            f"this build recipe is cached at {out}; give the teacher a path, a build.vocab_size for "
            "a tiny teacher with its own tokenizer, or build.init student"
        )
    sub = teacher_build_config(ws.cfg, t).model_copy(update={"run_dir": str(out)})
    origin = "the student's weights" if from_student else f"a fresh model (vocab {sub.model.spec.vocab_size})"
    ws.console.print(
        f"building teacher {t.name!r} into {out}: {sub.sft.steps} SFT steps on {sub.sft.num_demos} "
        f"demonstrations{of_families(sub.sft.families)} from {origin}"
    )
    tws = open_workspace(sub, show_progress=ws.show_progress)
    tws.console = ws.console
    if from_student:
        tok, model = ws.tokenizer, copy.deepcopy(student)
    else:
        base = build_tiny_model(
            tws.env_entry, out / "base_model", sub.model.spec, sub.model.tokenizer_corpus_tasks, sub.seed, sub.prompt
        )
        tok, model = load_policy(base)
    tws.bind_tokenizer(tok)
    return sft_stage(tws, model, resume=True)


def of_families(families: list[str] | None) -> str:
    """`` of families a, b`` for a family filter, nothing for every family."""
    return f" of families {', '.join(families)}" if families else ""


def cached_build_intact(ws: Workspace, t: TeacherConfig, final: Path) -> bool:
    """Whether a teacher built before passes its checksums (a damaged or unchecked one is said, and rebuilt:
    its SFT stage resumes, rebuilding its final weights from its last intact checkpoint)."""
    try:
        require_manifest(final)
    except CorruptCheckpointError as e:
        ws.console.print(
            f"[red]teacher {t.name!r}: the cached build is not intact ({escape(str(e))}); rebuilding[/red]"
        )
        return False
    return True


def checkpoint_dir(what: str, path: str) -> Path:
    """A teacher's ``path`` as a directory: a GGUF source (a ``.gguf`` file, a short name such as ``smollm2``)
    is imported (:func:`mentorrl.models.gguf.resolve_model_path`); a file that will not import is named."""
    try:
        return Path(resolve_model_path(path))
    except GGUFImportError as e:
        raise FileNotFoundError(f"{what}: {e}") from None


def teacher_path(ws: Workspace, t: TeacherConfig, student=None) -> Path:
    """Teacher ``t``'s checkpoint directory: its ``path``, or the one :func:`build_teacher` builds."""
    path = checkpoint_dir(f"teacher {t.name!r}", t.path) if t.path else build_teacher(ws, t, student)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"teacher {t.name!r}: {path} is not a Hugging Face checkpoint directory")
    return path


def load_teacher(ws: Workspace, t: TeacherConfig, student=None):
    """Teacher ``t`` in this process (``student``: the policy a ``build.init: student`` teacher starts from)."""
    return teacher_from_checkpoint(teacher_path(ws, t, student), ws.tokenizer, t, teacher_placement(ws.cfg, t))


def serve_teachers(ws: Workspace, teachers: list[TeacherConfig], student=None) -> list:
    """Under ``distributed.backend: ray`` with ``teacher_workers > 0``: one
    :class:`~mentorrl.distributed.ray_teachers.RayTeacher` per teacher (its actors load the checkpoint
    themselves); else an empty list (the teachers score in this process)."""
    dist = ws.cfg.distributed
    if dist.backend != "ray" or dist.teacher_workers == 0:
        return []
    from mentorrl.distributed.ray_teachers import RayTeacher, check_cpus

    check_cpus(dist, len(teachers))
    served: list = []
    try:
        for t in teachers:
            served.append(RayTeacher(dist, teacher_path(ws, t, student), ws.tokenizer, t))
    except BaseException:
        for r in served:
            r.close()
        raise
    return served

"""Building the base model a recipe starts from: a tokenizer trained on expert transcripts and a
fresh (optionally pretrained) Qwen2-architecture model, or the package's shipped copy of it, or the
checkpoint ``model.path`` names.

Kept apart from :mod:`mentorrl.train.pipeline` so the stages that build teachers (OPD, black-box)
import it without importing the pipeline that dispatches them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from mentorrl.models.build import ModelSpec, dir_digest, init_model
from mentorrl.models.corpus import expert_transcripts
from mentorrl.models.gguf import GGUFImportError, resolve_model_path
from mentorrl.models.hub import checkpoint_problem
from mentorrl.models.pretrain import PretrainSpec, run_pretraining
from mentorrl.models.pretrain import config_hash as pretrain_config_hash
from mentorrl.models.shipped import find_shipped_base, install_shipped_base


def build_config(
    env_name: str, spec: ModelSpec, corpus_tasks: int, seed: int, fmt=None, pretrain: PretrainSpec | None = None
) -> dict[str, Any]:
    """Everything that determines a built base model; its hash names the build."""
    pretrain = pretrain or PretrainSpec()
    return {
        "env": env_name,
        "spec": spec.model_dump(mode="json"),
        "tokenizer_corpus_tasks": corpus_tasks,
        "seed": seed,
        # how the tiny model's corpus is rendered (tool_format and native_tools only concern a checkpoint's own
        # template: not build inputs)
        "prompt": fmt.model_dump(mode="json", exclude={"tool_format", "native_tools"}) if fmt is not None else None,
        "pretrain": pretrain.model_dump(mode="json", exclude={"corpus_version"}),
        **({"corpus_version": pretrain.corpus_version} if pretrain.steps > 0 else {}),
    }


def build_tiny_model(
    env_entry,
    out_dir: Path,
    spec: ModelSpec,
    corpus_tasks: int,
    seed: int = 0,
    fmt=None,
    pretrain: PretrainSpec | None = None,
    command: str | None = None,
    use_shipped: bool = True,
) -> Path:
    """Tokenizer trained on expert transcripts of train tasks + a fresh Qwen2-architecture model,
    pretrained on the environment's language when ``pretrain.steps > 0`` (see
    :mod:`mentorrl.models.pretrain`). Writes ``mentorrl_build.json``: the build config and its
    hash, the command, and (when pretrained) the corpus size and loss curve.

    When the package ships a base built from the same config (same hash; see
    :mod:`mentorrl.models.shipped`) and ``use_shipped`` is true, that base is copied instead."""
    if (out_dir / "model.safetensors").exists() and (out_dir / "tokenizer.json").exists():
        return out_dir
    t0 = time.perf_counter()
    pretrain = pretrain or PretrainSpec()
    env = env_entry.make_env()
    env_name = str(getattr(env, "name", ""))
    config = build_config(env_name, spec, corpus_tasks, seed, fmt, pretrain)
    chash = pretrain_config_hash(config)
    shipped = find_shipped_base(chash) if use_shipped else None
    if shipped is not None:
        env.close()
        return install_shipped_base(shipped, out_dir)
    expert = env_entry.make_expert()
    try:
        corpus = list(
            expert_transcripts(env, expert, env_entry.make_tasks().tasks(split="train", n=corpus_tasks, seed=seed), fmt)
        )
    finally:
        env.close()
    record: dict[str, Any] = {}

    def before_save(tokenizer, model) -> None:
        if pretrain.steps > 0:
            record["pretrain"] = run_pretraining(env_entry, env_name, tokenizer, model, pretrain, fmt)

    path = init_model(out_dir, corpus, spec, before_save=before_save)
    build = {
        "command": command,
        "config": config,
        "config_hash": chash,
        "tokenizer_corpus": {"docs": len(corpus), "chars": sum(map(len, corpus))},
        **record,
        "digest": dir_digest(path),
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    (path / "mentorrl_build.json").write_text(json.dumps(build, indent=2))
    return path


def base_model_dir(ws) -> Path | str:
    """The run's base model for ``from_pretrained``: ``model.path`` as written (a checkpoint directory, or a
    hub id in the local Hugging Face cache), the checkpoint directory a GGUF ``model.path`` (a ``.gguf`` file
    or a short name such as ``smollm2``) was imported into (converted on first use, then cached: see
    :mod:`mentorrl.models.gguf`), or the tiny model built under the run dir."""
    if ws.cfg.model.path is not None:
        problem = checkpoint_problem("model.path", ws.cfg.model.path)
        if problem is not None:
            raise FileNotFoundError(problem)
        try:
            path = resolve_model_path(ws.cfg.model.path)
        except GGUFImportError as e:
            raise FileNotFoundError(f"model.path {ws.cfg.model.path}: {e}") from None
        return Path(path) if Path(path).is_dir() else path
    # the base is a function of model.* alone (like a real checkpoint); the run seed varies post-training only
    return build_tiny_model(
        ws.env_entry,
        ws.run_dir / "base_model",
        ws.cfg.model.spec,
        ws.cfg.model.tokenizer_corpus_tasks,
        ws.cfg.model.spec.seed,
        ws.cfg.prompt,
        pretrain=ws.cfg.model.pretrain,
    )


def adapt_policy(ws, model, model_dir: Path):
    """The policy the stages train: ``model`` itself, or with ``model.lora`` set, ``model`` wrapped with
    LoRA adapters (:func:`mentorrl.models.lora.apply_lora`; the saved adapter names ``model_dir`` as
    its base, and the adapters' initialisation is seeded by the run's seed)."""
    spec = ws.cfg.model.lora
    if spec is None:
        return model
    from mentorrl.models.lora import apply_lora, trainable_summary

    model = apply_lora(model, spec, base_path=model_dir, seed=ws.cfg.seed)
    trainable, total = trainable_summary(model)
    ws.console.print(
        f"LoRA r={spec.r} alpha={spec.alpha:g} on {', '.join(spec.target_modules)}: "
        f"{trainable / 1e6:.3f}M of {total / 1e6:.2f}M parameters train"
    )
    return model

"""LoRA adapters on the policy through ``peft`` (the ``model.lora`` config section).

:func:`apply_lora` wraps the loaded policy with ``get_peft_model``: its base weights are frozen, the
adapters train, and the learner's optimizer holds only theirs (it takes the parameters that require
a gradient). Every stage shares that Learner, so SFT, GRPO, PPO, SAO, OPD and the black-box stages
train the same adapters, one after the other in a recipe.

On disk (checkpoints and each stage's ``final/``) an adapted policy is its adapter, as ``peft``'s
``save_pretrained`` writes it: ``adapter_model.safetensors`` and ``adapter_config.json``, whose
``base_model_name_or_path`` names the base checkpoint (an absolute path), beside the tokenizer.
:func:`load_adapter_weights` restores one exactly; :func:`export_merged` writes the merged model,
a plain directory ``AutoModelForCausalLM.from_pretrained`` (and vLLM) loads.

The rollout side (the module the engine runs, merged weights for vLLM) is
:mod:`mentorrl.rollout.adapters`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from mentorrl.config import ConfigError
from mentorrl.rollout.adapters import base_module, is_adapted, merged_state_dict, save_merged

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
LORA_TYPES = (torch.nn.Linear, torch.nn.Embedding)  # the module kinds target_modules may name here


def target_matches(model, target: str) -> list[str]:
    """The module names of ``model`` that ``target`` selects (peft's rule for a list of names: the
    full dotted name, or its last components)."""
    return [n for n, _ in model.named_modules() if n and (n == target or n.endswith("." + target))]


def validate_target_modules(model, targets: list[str]) -> None:
    """Every name in ``targets`` selects at least one module of ``model``, and only Linear or Embedding
    modules; raises :class:`ConfigError` naming ``model.lora.target_modules`` and what the model has."""
    modules = dict(model.named_modules())
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if n and isinstance(m, LORA_TYPES)})
    for t in targets:
        hits = target_matches(model, t)
        if not hits:
            raise ConfigError(
                f"model.lora.target_modules: {t!r} matches no module of the model "
                f"(its Linear / Embedding modules: {', '.join(linear)})"
            )
        bad = [n for n in hits if not isinstance(modules[n], LORA_TYPES)]
        if bad:
            raise ConfigError(
                f"model.lora.target_modules: {t!r} selects {bad[0]} ({type(modules[bad[0]]).__name__}), "
                f"not a Linear or Embedding module (those are: {', '.join(linear)})"
            )
        tied = sorted(set(hits) & _tied_embedding_names(model))
        if tied:
            raise ConfigError(
                f"model.lora.target_modules: {t!r} selects {tied[0]}, whose weight is tied to the other "
                "end of the model (tie_word_embeddings): an adapter there changes one end only, so no merged "
                "model equals the adapted one; leave it out"
            )


def _tied_embedding_names(model) -> set[str]:
    """The names of the input and output embeddings when they share one weight, else none."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb_in, emb_out = get_in() if get_in else None, get_out() if get_out else None
    w_in, w_out = getattr(emb_in, "weight", None), getattr(emb_out, "weight", None)
    if w_in is None or w_out is None or w_in.data_ptr() != w_out.data_ptr():
        return set()
    return {n for n, m in model.named_modules() if m is emb_in or m is emb_out}


def apply_lora(model, spec, base_path: str | Path | None = None, seed: int = 0):
    """``model`` wrapped with LoRA adapters of ``spec`` (a :class:`mentorrl.config.LoraSpec`), in eval
    mode; the adapters' initialisation is seeded by ``seed`` (the global RNG is left as it was).
    ``base_path``: the base checkpoint the saved adapter names (default: the model's own)."""
    from peft import LoraConfig, get_peft_model

    if is_adapted(model):
        raise ValueError("the model already carries peft adapters")
    validate_target_modules(model, list(spec.target_modules))
    cfg = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers a deprecated question
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, cfg)
    if base_path is not None:
        wrapped.peft_config["default"].base_model_name_or_path = str(Path(base_path).resolve())
    wrapped.eval()
    return wrapped


def trainable_summary(model) -> tuple[int, int]:
    """(trainable parameters, all parameters) of ``model``."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _check_adapter_config(model, directory: Path) -> None:
    try:
        saved = json.loads((directory / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{directory / ADAPTER_CONFIG}: unreadable ({e})") from e
    own = model.peft_config["default"]
    for key, have in (("r", own.r), ("lora_alpha", own.lora_alpha), ("target_modules", own.target_modules)):
        want = saved.get(key)
        if key == "target_modules":
            have, want = sorted(have or []), sorted(want or [])
        if want != have:
            raise ValueError(f"{directory / ADAPTER_CONFIG}: {key} {want!r}, but this run's adapters have {have!r}")


@torch.no_grad()
def load_adapter_weights(model, directory: str | Path) -> None:
    """Copy the adapter saved in ``directory`` into the adapted ``model``, exactly; raises when the
    directory holds no adapter or one of another shape (rank, targets, alpha)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    directory = Path(directory)
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory} holds no LoRA adapter ({ADAPTER_WEIGHTS}); was it written without model.lora?"
        )
    _check_adapter_config(model, directory)
    state = load_file(str(path))
    want = get_peft_model_state_dict(model)
    if set(state) != set(want):
        missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
        raise ValueError(
            f"{path}: adapter tensors differ from this model's (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for k, v in state.items():
        if v.shape != want[k].shape:
            raise ValueError(f"{path}: {k} has shape {tuple(v.shape)}, this model's {tuple(want[k].shape)}")
    set_peft_model_state_dict(model, state)


def check_weights_kind(model, directory: str | Path) -> None:
    """Before resuming from ``directory``: a LoRA policy needs an adapter there and a full policy a full
    model. Raises :class:`ConfigError` naming ``model.lora`` otherwise (the checkpoint is not damaged:
    the config changed), so the checkpoint is never moved aside as corrupt."""
    d = Path(directory)
    if is_adapted(model) and not is_adapter_dir(d) and (d / "config.json").is_file():
        raise ConfigError(f"model.lora is set, but {d} holds a full model, not an adapter: resume without model.lora")
    if not is_adapted(model) and is_adapter_dir(d):
        raise ConfigError(f"model.lora is null, but {d} holds a LoRA adapter: resume with the run's model.lora")


def adapter_base_path(directory: str | Path) -> str:
    """The base checkpoint an adapter directory names (``adapter_config.json``'s base_model_name_or_path)."""
    cfg = json.loads((Path(directory) / ADAPTER_CONFIG).read_text())
    base = cfg.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{Path(directory) / ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    return str(base)


def resolve_model_dir(path: str | Path) -> Path:
    """The model directory ``path`` means: itself when it holds an adapter or a model; a stage dir's
    ``final/``; a run dir's last finished stage (its recipe order, from ``config.yaml``)."""
    p = Path(path)
    if is_adapter_dir(p) or (p / "config.json").is_file():
        return p
    if (p / "final" / "DONE").is_file():
        return p / "final"
    recipe: list[str] = []
    if (p / "config.yaml").is_file():
        import yaml

        recipe = list((yaml.safe_load((p / "config.yaml").read_text()) or {}).get("recipe") or [])
    done = [s for s in recipe if (p / s / "final" / "DONE").is_file()]
    if done:
        return p / done[-1] / "final"
    raise FileNotFoundError(
        f"{p}: not a model or adapter directory, a stage dir with final/, or a run dir with a finished stage"
    )


def load_adapted(directory: str | Path, base: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """The ``peft`` model of the adapter in ``directory`` on its base (``base``: instead of the one it names)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = str(base) if base is not None else adapter_base_path(directory)
    if not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"the adapter's base model {base} is not a checkpoint directory here (pass --base)")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    return PeftModel.from_pretrained(model, str(directory)).eval()


def export_merged(src: str | Path, out_dir: str | Path, base: str | Path | None = None) -> Path:
    """Write the merged model of ``src`` (see :func:`resolve_model_dir`) and its tokenizer to ``out_dir``:
    ``config.json`` + ``model.safetensors`` that ``AutoModelForCausalLM.from_pretrained`` (and vLLM)
    loads. Adapters are merged in float32 and saved in the base checkpoint's dtype. A directory that
    is already a full model is written out as it is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = resolve_model_dir(src)
    out = Path(out_dir)
    if is_adapter_dir(directory):
        model = load_adapted(directory, base)
        dtype = getattr(base_module(model).config, "dtype", None) or torch.float32
        merged = model.merge_and_unload()
    else:
        merged = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        dtype = torch.float32
    merged.to(dtype if isinstance(dtype, torch.dtype) else torch.float32).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(directory).save_pretrained(out)
    return out


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapter_base_path",
    "apply_lora",
    "base_module",
    "check_weights_kind",
    "export_merged",
    "is_adapted",
    "is_adapter_dir",
    "load_adapted",
    "load_adapter_weights",
    "merged_state_dict",
    "resolve_model_dir",
    "save_merged",
    "target_matches",
    "trainable_summary",
    "validate_target_modules",
]

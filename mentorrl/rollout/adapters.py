"""What a rollout engine decodes when the policy carries LoRA adapters (``model.lora``, through ``peft``).

A ``peft`` wrapper (``PeftModel``) holds the Hugging Face model whose Linear modules it replaced by
LoRA layers; running those modules applies the adapters. So the project's engine and the learner's
module-by-module forwards run :func:`base_module` (the wrapped model, adapters inside), and an
engine that loads plain weights (vLLM) gets :func:`merged_state_dict`: every adapted weight
``W + scale * B @ A``, under the base model's own names, computed without copying the model.

Duck-typed (no ``peft`` import): a model is adapted when it has ``peft_config`` and ``get_base_model``.
"""

from __future__ import annotations

from pathlib import Path

import torch


def is_adapted(model) -> bool:
    """Whether ``model`` is a ``peft`` wrapper (its adapters live inside :func:`base_module`)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def base_module(model):
    """The Hugging Face model a ``peft`` wrapper runs (LoRA layers inside its Linear modules), or ``model``."""
    return model.get_base_model() if is_adapted(model) else model


def _adapter_layers(base) -> dict[str, torch.nn.Module]:
    """Name -> LoRA layer (a module with ``base_layer`` and ``get_delta_weight``) in ``base``."""
    return {
        name: mod
        for name, mod in base.named_modules()
        if hasattr(mod, "base_layer") and callable(getattr(mod, "get_delta_weight", None))
    }


def _delta(layer) -> torch.Tensor | None:
    """The layer's unmerged update (summed over its active adapters), shaped like its base weight; None
    when nothing is to add (merged already, or no active adapter on it)."""
    if getattr(layer, "merged", False):
        return None
    if any(getattr(layer, "use_dora", {}).get(a, False) for a in layer.active_adapters):
        raise ValueError("merged weights of DoRA adapters are not supported")
    own = set(getattr(layer, "lora_A", {})) | set(getattr(layer, "lora_embedding_A", {}))
    names = [a for a in layer.active_adapters if a in own]
    if not names:
        return None
    return sum(layer.get_delta_weight(a) for a in names)


def is_adapter_key(key: str) -> bool:
    """Whether a parameter name is a LoRA adapter's own tensor (``...lora_A.default.weight``)."""
    return any(part.startswith("lora_") for part in key.split("."))


@torch.no_grad()
def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """``model``'s weights as a plain checkpoint of its base architecture: for a ``peft`` wrapper,
    every adapted weight merged (``W + scale * B @ A``, what ``merge_and_unload()`` computes), the
    adapters' own tensors left out and ``.base_layer`` dropped from the names; tied weights stay
    one tensor. Any other model: its ``state_dict()``. The model itself is not changed."""
    if not is_adapted(model):
        return model.state_dict()
    base = base_module(model)
    merged: dict[int, torch.Tensor] = {}  # data_ptr of a base weight -> its merged tensor
    for layer in _adapter_layers(base).values():
        d = _delta(layer)
        if d is not None:
            w = layer.base_layer.weight
            merged[w.data_ptr()] = (w + d.to(w.dtype)).detach()
    out: dict[str, torch.Tensor] = {}
    for k, v in base.state_dict().items():
        if is_adapter_key(k):
            continue
        out[k.replace(".base_layer.", ".")] = merged.get(v.data_ptr(), v) if v.numel() else v
    return out


def save_merged(model, out_dir: str | Path) -> Path:
    """Write ``model`` as a plain Hugging Face directory: a ``peft`` wrapper as its base config and
    ``model.safetensors`` of :func:`merged_state_dict` (a tied weight written once, under its first
    name); any other model through its own ``save_pretrained``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if not is_adapted(model):
        model.save_pretrained(out, safe_serialization=True)
        return out
    out.mkdir(parents=True, exist_ok=True)
    base = base_module(model)
    base.config.save_pretrained(out)
    gen = getattr(base, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out)
    seen: set[int] = set()
    state: dict[str, torch.Tensor] = {}
    for k, v in merged_state_dict(model).items():
        ptr = v.data_ptr()
        if v.numel() and ptr in seen:
            continue
        seen.add(ptr)
        state[k] = v.detach().to("cpu").contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


__all__ = ["base_module", "is_adapted", "is_adapter_key", "merged_state_dict", "save_merged"]

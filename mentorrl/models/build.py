"""Build the default tiny tokenizer and model locally, deterministically, with no download.

The result is an ordinary Hugging Face directory (``tokenizer.json``, ``config.json``,
``model.safetensors``) loaded with ``AutoTokenizer`` / ``AutoModelForCausalLM``, so
every other code path is the one a user's real checkpoint takes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from mentorrl.contract import CHAT_TEMPLATE, IM_END, MAX_STATED_CONTEXT, PAD, SPECIAL_TOKENS
from mentorrl.core.checksums import verify_manifest
from mentorrl.models.spec import ModelSpec

# Pre-tokenisation is exactly Qwen2's (NFC, then its split regex, then byte-level): the model is a
# Qwen2-architecture checkpoint, and `AutoTokenizer` -- hence vLLM, TRL and every other tool -- loads a
# `qwen2` checkpoint's tokenizer as `Qwen2Tokenizer`, which rebuilds the normaliser and pre-tokeniser
# from these fixed settings whatever tokenizer.json says. Any other choice here would be trained on one
# tokenisation and served another (it was: numbers and spaces were split differently after reloading).
# Digits are single tokens, as in Qwen2.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_tokenizer(corpus: Iterable[str], vocab_size: int):
    """Byte-level BPE with Qwen2's normaliser and pre-tokeniser (digits split one by one) and the
    ChatML special tokens; it loads back through ``AutoTokenizer`` unchanged."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (IM_END, PAD)],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_model(tokenizer, spec: ModelSpec):
    return build_model_for_vocab(len(tokenizer), spec, tokenizer.eos_token_id, tokenizer.pad_token_id)


def build_model_for_vocab(
    vocab_size: int, spec: ModelSpec, eos_token_id: int | None = None, pad_token_id: int | None = None
):
    """A fresh Qwen2-architecture causal LM of size ``spec`` over ``vocab_size`` token ids, seeded by ``spec.seed``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    return model


def dir_digest(path: str | Path) -> str:
    """Hash of the weight and tokenizer files: equal digests mean an identical build."""
    h = hashlib.sha256()
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        p = Path(path) / name
        if p.exists():
            h.update(name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def init_model(
    out_dir: str | Path,
    corpus: Iterable[str],
    spec: ModelSpec | None = None,
    before_save: Callable[[Any, Any], None] | None = None,
) -> Path:
    """Train the tokenizer on ``corpus``, build the model and save both to ``out_dir``.

    ``before_save(tokenizer, model)``, when given, runs on the fresh model before it is saved
    (pretraining: see :mod:`mentorrl.models.pretrain`)."""
    spec = spec or ModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus, spec.vocab_size)
    model = build_model(tokenizer, spec)
    tokenizer.save_pretrained(out)
    model.config.save_pretrained(out)
    if before_save is not None:  # pretraining sees the tokenizer exactly as every later stage loads it
        from transformers import AutoTokenizer

        before_save(AutoTokenizer.from_pretrained(out), model)
    model.save_pretrained(out, safe_serialization=True)
    (out / "mentorrl_spec.json").write_text(json.dumps(spec.model_dump(), indent=2))
    return out


def load_policy(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
    """Load a tokenizer and causal LM the way any Hugging Face checkpoint loads, its weights in ``dtype``
    on ``device`` (None: the CPU; see :mod:`mentorrl.models.device` for the config's names); a directory that
    carries a checksum manifest (a mentorrl run's checkpoint or final weights) is verified against it first. A
    GGUF source (a ``.gguf`` file, or a short name such as ``smollm2``) loads from the checkpoint directory it is
    imported into (:func:`mentorrl.models.gguf.resolve_model_path`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mentorrl.models.gguf import resolve_model_path

    model_dir = resolve_model_path(model_dir)
    if Path(model_dir).is_dir():
        verify_manifest(Path(model_dir))

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if device is not None:
        model = model.to(device)
    model.eval()
    state_context(tokenizer, model)
    return tokenizer, model


def state_context(tokenizer, model) -> None:
    """A tokenizer that states no context length (transformers' sentinel, as a GGUF import leaves it) takes
    the model's ``max_position_embeddings``: the rollout contract caps an episode's budget by it."""
    stated = getattr(tokenizer, "model_max_length", None)
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if (
        not (isinstance(stated, int) and 0 < stated < MAX_STATED_CONTEXT)
        and isinstance(positions, int)
        and positions > 0
    ):
        tokenizer.model_max_length = positions

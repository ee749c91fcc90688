"""Vocabulary transplant: a checkpoint re-fitted to another tokenizer, body weights unchanged.

Every weight but the token embeddings (and an untied output head) is kept. A token of the new
vocabulary gets the mean of the old embeddings of its spelling in the old vocabulary: the exact old
row when the old vocabulary has the same token (the same byte string, or the same special token),
else the mean over the old tokens that spell it. This is the usual zero-shot initialisation of
tokenizer transplantation (as in mergekit's ``tokensurgeon`` or FOCUS without the similarity
weights); a short fine-tune under the new tokenizer then repairs what the means lose.

In mentorrl it makes a *cross-tokenizer teacher of known strength*: a strong checkpoint moved onto
a tokenizer of its own, so cross-tokenizer OPD can be compared with same-tokenizer OPD from what is
otherwise the same teacher (``mentorrl transplant-vocab``).

Both tokenizers must be byte-level BPE (GPT-2 / Qwen2 / Llama-3 style): a token of either is a
string over the same 256-symbol byte alphabet, so the old BPE model can spell any new token.
"""

from __future__ import annotations

import copy
import json

import torch


class TransplantError(ValueError):
    pass


def _byte_level(tok) -> bool:
    state = json.loads(tok.backend_tokenizer.to_str())
    pre = json.dumps(state.get("pre_tokenizer") or {})
    return state.get("model", {}).get("type") == "BPE" and "ByteLevel" in pre


def spell_in(old_tok, new_tok) -> list[list[int]]:
    """For every new token id, the old token ids that spell it (one id when both vocabularies have it)."""
    if not (_byte_level(old_tok) and _byte_level(new_tok)):
        raise TransplantError("vocabulary transplant needs two byte-level BPE tokenizers")
    old_vocab = old_tok.get_vocab()
    old_model = old_tok.backend_tokenizer.model
    specials_new = set(new_tok.all_special_tokens) | {t.content for t in new_tok.added_tokens_decoder.values()}
    out: list[list[int]] = []
    for i in range(len(new_tok)):
        piece = new_tok.convert_ids_to_tokens(i)
        if piece is None:
            raise TransplantError(f"new tokenizer has no token for id {i}")
        if piece in old_vocab:
            out.append([old_vocab[piece]])
        elif piece in specials_new:
            raise TransplantError(
                f"special token {piece!r} of the new tokenizer is not in the old one: map it "
                "by hand (its embedding has no spelling to average)"
            )
        else:
            ids = [t.id for t in old_model.tokenize(piece)]
            if not ids:
                raise TransplantError(f"the old tokenizer cannot spell new token {i} ({piece!r})")
            out.append(ids)
    return out


def transplant_vocabulary(model, old_tok, new_tok, spellings: list[list[int]] | None = None):
    """A copy of ``model`` whose embeddings (and untied output head) follow ``new_tok``
    (``spellings``: :func:`spell_in`'s result, when the caller has it already)."""
    old_in = model.get_input_embeddings().weight.detach()
    if old_in.shape[0] < len(old_tok):
        raise TransplantError(
            f"model has {old_in.shape[0]} embedding rows, fewer than the old tokenizer's "
            f"{len(old_tok)} tokens: the tokenizer is not this model's"
        )
    spellings = spell_in(old_tok, new_tok) if spellings is None else spellings

    def remap(old_w: torch.Tensor) -> torch.Tensor:  # a shared token's mean is its one old row, exactly
        return torch.stack([old_w[ids].mean(0) for ids in spellings]).to(old_w.dtype)

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    old_out = None if tied else model.get_output_embeddings().weight.detach()
    new = copy.deepcopy(model)
    new.resize_token_embeddings(len(new_tok))
    with torch.no_grad():
        new.get_input_embeddings().weight.copy_(remap(old_in))
        if old_out is not None:
            new.get_output_embeddings().weight.copy_(remap(old_out))
    if tied:
        new.tie_weights()
    cfg = new.config
    cfg.vocab_size = len(new_tok)
    cfg.eos_token_id = new_tok.eos_token_id
    cfg.pad_token_id = new_tok.pad_token_id
    if getattr(new, "generation_config", None) is not None:
        new.generation_config.eos_token_id = new_tok.eos_token_id
        new.generation_config.pad_token_id = new_tok.pad_token_id
    return new


def exact_share(spellings: list[list[int]]) -> float:
    """The share of the new vocabulary copied exactly (a token the old vocabulary has too), from
    :func:`spell_in`'s result."""
    return sum(len(s) == 1 for s in spellings) / len(spellings)

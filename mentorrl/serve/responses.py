"""Samples -> the OpenAI response: choices, per-token ``logprobs``, and the streamed chunks.

A turn reads back as one assistant message (:func:`turn_message`): a call the request's
:class:`~mentorrl.serve.tools.ToolPolicy` accepts becomes ``tool_calls`` (the text before it, if any, the
``content``); any other turn is text, stripped (``content``). A streamed choice (:class:`ChoiceStream`)
sends its text as it is written, holding back what may still turn out to be a call, the start of a
stop string or half a UTF-8 character; at its end it sends the rest, so the reassembled content, tool
calls and log-probs equal the non-streamed reply for the same seed."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any, Sequence

from mentorrl.serve.generation import Sample, TokenLogprob
from mentorrl.serve.render import ChatRenderer
from mentorrl.serve.tools import ToolPolicy
from mentorrl.trajectory import dumps_compact

MIN_LOGPROB = -9999.0  # what OpenAI reports for an impossible token (JSON has no -inf)


def byte_level_alphabet() -> dict[int, str]:
    """Byte -> the character byte-level BPE (GPT-2, Qwen, Llama 3) writes it as."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    out, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class TokenTexts:
    """Token id -> (text, UTF-8 bytes) as ``logprobs`` shows a token; byte-level BPE tokens give their
    exact bytes (half a character included), other tokens their decoded text."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self._cache = tokenizer, {}
        dec = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = dec is not None and "ByteLevel" in str(dec)
        self._added = {int(i): str(t) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self._bytes: dict[str, int] = {}
        if self._byte_level:
            self._bytes = {c: b for b, c in byte_level_alphabet().items()}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._text(token_id)
        return hit

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        if token_id in self._added:
            raw = self._added[token_id].encode()
        else:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if self._byte_level and isinstance(piece, str) and all(c in self._bytes for c in piece):
                raw = bytes(self._bytes[c] for c in piece)
            else:
                raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8", "replace")
        return raw.decode("utf-8", errors="replace"), list(raw)


def logprob_entry(entry: TokenLogprob, texts: TokenTexts) -> dict[str, Any]:
    """One token of ``logprobs.content``: ``{token, logprob, bytes, top_logprobs}``."""

    def one(token_id: int, lp: float) -> dict[str, Any]:
        text, raw = texts(token_id)
        return {"token": text, "logprob": max(float(lp), MIN_LOGPROB), "bytes": raw}

    return {**one(entry.token_id, entry.logprob), "top_logprobs": [one(i, lp) for i, lp in entry.top]}


def logprobs_of(entries: Sequence[TokenLogprob] | None, texts: TokenTexts) -> dict[str, Any] | None:
    return None if entries is None else {"content": [logprob_entry(e, texts) for e in entries]}


def call_id(seed: int | None, index: int, text: str) -> str:
    """A tool call's id: derived from the seed, the choice and the turn for a seeded request (so the
    reply repeats, streamed or not), else random."""
    if seed is None:
        return f"call_{uuid.uuid4().hex[:24]}"
    return "call_" + hashlib.blake2b(f"{seed}/{index}/{text}".encode(), digest_size=12).hexdigest()


def turn_message(renderer: ChatRenderer, policy: ToolPolicy, text: str, cid: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of a turn's whole text (a prefill included), and whether it is a call."""
    if policy.parses:
        action = renderer.parse(text)
        if action.kind == "tool" and policy.accepts(action.name, action.arguments):
            start = renderer.call_start(text) or 0
            call = {
                "id": cid,
                "type": "function",
                "function": {"name": action.name, "arguments": dumps_compact(action.arguments)},
            }
            return {"role": "assistant", "content": text[:start].strip() or None, "tool_calls": [call]}, True
        if action.kind == "answer":
            return {"role": "assistant", "content": action.text or ""}, False
    return {"role": "assistant", "content": text.strip()}, False


def finish_reason(sample: Sample, is_call: bool) -> str:
    return "tool_calls" if is_call and sample.finish_reason == "stop" else sample.finish_reason


class ChoiceStream:
    """One streamed choice: tokens in (:meth:`token`), content deltas out; :meth:`finish` gives the rest."""

    def __init__(
        self, renderer: ChatRenderer, policy: ToolPolicy, prefill: str, stops: Sequence[str], stop_ids: Sequence[int]
    ):
        self.renderer, self.policy, self.prefill = renderer, policy, prefill
        self.stops, self.stop_ids = tuple(stops), set(stop_ids)
        self.ids: list[int] = []
        self.done, self.emitted, self.sent = False, "", 0  # sent: log-prob entries sent
        self.hold = policy.forced or not renderer.incremental  # the whole turn is decided at its end

    def token(self, token_id: int) -> str | None:
        """The content delta after ``token_id`` ("" for none), or None once the turn has ended."""
        if self.done:
            return None
        self.ids.append(token_id)
        if token_id in self.stop_ids:
            self.done = True
            return ""
        text = self.renderer.tokenizer.decode(self.ids, skip_special_tokens=False)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, self.done = text[:cut], True
        return "" if self.hold else self._delta(self.prefill + text)

    def _delta(self, text: str) -> str:
        if self.policy.parses:
            start = self.renderer.call_start(text)
            text = text if start is None else text[:start]
        if not self.done:
            for s in self.stops:  # a suffix that may be a stop string's start
                k = next((k for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), 0)
                text = text[: len(text) - k] if k else text
        candidate = text.rstrip("\ufffd").strip()  # half a character waits for its other half
        if len(candidate) > len(self.emitted) and candidate.startswith(self.emitted):
            delta, self.emitted = candidate[len(self.emitted) :], candidate
            return delta
        return ""

    def finish(self, message: dict[str, Any]) -> str:
        """The content not yet sent of the final ``message`` ("" when all of it went out)."""
        content = message.get("content") or ""
        return content[len(self.emitted) :] if content.startswith(self.emitted) else ""


def tool_call_deltas(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The streamed deltas of a message's tool calls: name (with id and type) first, then the arguments."""
    out = []
    for k, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        head = {"index": k, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}
        out.append({"tool_calls": [head]})
        out.append({"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]})
    return out


def usage_of(prompt_tokens: int, samples: Sequence[Sample]) -> dict[str, int]:
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


__all__ = [
    "ChoiceStream",
    "MIN_LOGPROB",
    "TokenTexts",
    "call_id",
    "finish_reason",
    "logprob_entry",
    "logprobs_of",
    "tool_call_deltas",
    "turn_message",
    "usage_of",
]

"""Generation for the server: batched decoding, per-row sampling, per-token log-probs and streaming.

A :class:`GenRequest` is one request's prompt (token ids, as rendered) and settings; the
:class:`Batcher`'s worker runs the pending ones together through :meth:`PolicyGenerator.run`, which
gives each request its ``n`` :class:`Sample` s: the sampled ids, each one's behaviour log-prob (and
the most likely alternatives when asked) and the turn's text -- token in / token out, structured.

A batch is decoded by the rollouts' own decoder (:mod:`mentorrl.rollout.decoders`: per-row KV slots,
each prompt prefilled unpadded, one token per row and step after) where the model supports it, else
by ``model.generate`` on the left-padded batch; both sample through the same :class:`RowSampler`,
so they give the same turns and log-probs (up to float noise).

Log-probs are those of the distribution the token was sampled from before truncation:
``log_softmax(logits / T)`` over the full vocabulary (``T`` = 1 for greedy rows), as a rollout records
behaviour log-probs (:mod:`mentorrl.rollout.sampling`); top-p and a ``tool_choice: none`` ban cut what
can be sampled, not the recorded value. A streamed request gets each step's token on its
:attr:`GenRequest.events` queue as the model writes it (real incremental streaming, batch and all)."""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from mentorrl.serve.protocol import (
    DEFAULT_BATCH_WINDOW_MS,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_TOKENS_CAP,
    GREEDY_BELOW,
    APIError,
)
from mentorrl.serve.render import ChatRenderer

Turn = tuple[str, int, str]  # (text before the stop, tokens generated, finish reason)
DONE = ("done",)  # the last event on a streamed request's queue (its samples are on its future)


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token: its id, its log-prob and the ``k`` most likely tokens (id, log-prob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Sample:
    """One generated choice. ``token_ids``: the sampled ids that count as completion tokens (the stop
    token included, when one ended the turn); ``logprobs``: one :class:`TokenLogprob` each (None when the
    model never called the sampler, e.g. a scripted test model); ``text``: the generated text before the
    stop token or string; ``finish_reason``: "stop" or "length"."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    text: str
    finish_reason: str

    def turn(self) -> Turn:
        return self.text, len(self.token_ids), self.finish_reason


@dataclass
class GenRequest:
    """One request's generation: its prompt, ``n`` and settings; ``future`` receives its ``n`` samples.

    ``prompt_ids`` are the ids as rendered (a forced call's opening, ``prefill``, included);
    ``banned``: ids the turn may not sample; ``top_logprobs``: alternatives recorded per token;
    ``events``: a queue for streaming (each step's tokens, then :data:`DONE`), or None."""

    prompt_ids: list[int]
    n: int
    temperature: float
    top_p: float
    budget: int  # max_new_tokens, already within the cap and the context
    seed: int | None
    stop: tuple[str, ...]
    top_logprobs: int = 0
    banned: tuple[int, ...] = ()
    prefill: str = ""
    events: "queue.Queue[tuple] | None" = field(default=None, repr=False)
    future: Future = field(default_factory=Future, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW  # a tiny temperature would overflow the logits

    @property
    def rows(self) -> int:
        """Rows in a batch: greedy turns are all equal, so they are generated once."""
        return 1 if self.greedy else self.n

    @property
    def key(self) -> tuple[int, tuple[str, ...]]:
        """Requests with equal keys can share one ``generate`` call (sampling is done per row)."""
        return self.budget, self.stop


DECODERS = ("auto", "slots", "hf", "hf_generate")


class PolicyGenerator:
    """Generation for the server: a batch decoded together, the rendering's stop tokens.

    ``decoder``: ``slots`` (:class:`mentorrl.rollout.decoders.SlotDecoder`), ``hf`` (the model's
    ``forward`` over a ``DynamicCache``, :class:`mentorrl.rollout.decoders.DynamicCacheDecoder`),
    ``hf_generate`` (``model.generate`` on the left-padded batch), or ``auto``: slots where the model
    passes :func:`mentorrl.rollout.decoders.slot_decoder_checks`, else ``hf_generate``. A decoder is
    built for each :meth:`run` (a fraction of a millisecond; its KV buffers come from the model's
    pool), so the weights the learner wrote in place are the ones it runs.

    Sampling is plain temperature / top-p sampling over the full vocabulary (top-k off, no
    repetition penalty), whatever the checkpoint's ``generation_config`` says, so the server
    samples the distribution a rollout samples. It is done per row by :class:`RowSampler`, so a
    seeded request's turns do not depend on the requests batched with it."""

    def __init__(
        self,
        tokenizer: Any,
        model: Any,
        max_new_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP,
        renderer: ChatRenderer | None = None,
        decoder: str = "auto",
    ):
        if decoder not in DECODERS:
            raise ValueError(f"unknown decoder {decoder!r} ({', '.join(DECODERS)})")
        self.tokenizer, self.model, self.max_new_tokens_cap = tokenizer, model, max_new_tokens_cap
        self.decoder = decoder
        self.renderer = renderer or ChatRenderer(tokenizer)
        stops = {tokenizer.convert_tokens_to_ids(self.renderer.stop_token), tokenizer.eos_token_id}
        unk = getattr(tokenizer, "unk_token_id", None)
        self.stop_ids = sorted(i for i in stops if i is not None and i != unk)
        if not self.stop_ids:
            raise ValueError(
                f"tokenizer has neither {self.renderer.stop_token} nor an eos token: a turn could never end"
            )
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.pad_id = int(pad)
        self.max_positions = _max_positions(model, tokenizer)
        self.encoder = self.renderer.encoder

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """The conversation's ids; content is plain text, control tokens come from the template.
        Raises :class:`MessageError` for a message that cannot be rendered."""
        return self.renderer.prompt_ids(self.renderer.prompt_pieces(messages, tools))

    def request(
        self,
        prompt_ids: list[int],
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int | None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        **options: Any,
    ) -> GenRequest:
        """The :class:`GenRequest` for ``n`` turns after ``prompt_ids`` (``options``: its other fields).
        Raises :class:`APIError` (400) when the prompt leaves no room in the model's context."""
        budget = min(max_new_tokens or self.max_new_tokens_cap, self.max_new_tokens_cap)
        if self.max_positions is not None:
            room = self.max_positions - len(prompt_ids)
            if room < 1:
                raise APIError(
                    400,
                    f"the prompt is {len(prompt_ids)} tokens; the model's context is "
                    f"{self.max_positions} tokens, which leaves no room for a reply",
                    param="messages",
                )
            budget = min(budget, room)
        return GenRequest(list(prompt_ids), n, temperature, top_p, budget, seed, tuple(stop), **options)

    def run(self, batch: Sequence[GenRequest]) -> list[list[Sample]]:
        """Each request's ``n`` samples, from one decoding of all their rows (:meth:`decoder_kind`).

        The requests must share a :attr:`GenRequest.key`. A turn's finish reason is "stop" (a stop
        token or string) or "length"."""
        import torch

        budget, stop = batch[0].key
        rows = [(req, i) for req in batch for i in range(req.rows)]
        width = max(len(req.prompt_ids) for req in batch)
        device = next(self.model.parameters()).device
        sampler = RowSampler(
            [r.temperature for r, _ in rows],
            [r.top_p for r, _ in rows],
            [None if r.greedy else row_generator(r.seed, i, device) for r, i in rows],
            device,
            banned=[r.banned for r, _ in rows],
            top_k=max(r.top_logprobs for r in batch),
        )
        streamer = RowStreamer(rows, sampler) if any(r.events is not None for r in batch) else None
        kind = self.decoder_kind()
        with torch.no_grad():
            if kind == "hf_generate":
                out = self._generate(rows, width, budget, stop, sampler, streamer, device)
            else:
                out = self._decode(kind, rows, width + budget, budget, stop, sampler, streamer)
        samples = [self._sample(row, j, stop, sampler, rows[j][0]) for j, row in enumerate(out)]
        replies, start = [], 0
        for req in batch:
            replies.append(samples[start : start + req.rows] * (req.n // req.rows))
            start += req.rows
        return replies

    def decoder_kind(self) -> str:
        """What decodes the next batch: ``slots``, ``hf`` or ``hf_generate`` (``auto`` resolved)."""
        if self.decoder != "auto":
            return self.decoder
        import torch

        from mentorrl.rollout.decoders import slot_decoder_checks

        ok = isinstance(self.model, torch.nn.Module) and slot_decoder_checks(self.model) is None
        return "slots" if ok else "hf_generate"  # checked once per model object

    def _generate(
        self,
        rows: list[tuple[GenRequest, int]],
        width: int,
        budget: int,
        stop: Sequence[str],
        sampler: RowSampler,
        streamer: RowStreamer | None,
        device: Any,
    ) -> list[list[int]]:
        """``model.generate`` on the left-padded prompts (with an attention mask): each row's new ids."""
        ids, mask = self._inputs(rows, width, device)
        kwargs = self._generate_kwargs(budget, stop, sampler)
        if streamer is not None:
            kwargs["streamer"] = streamer
        out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        return out[:, width:].tolist()

    def _decode(
        self,
        kind: str,
        rows: list[tuple[GenRequest, int]],
        max_len: int,
        budget: int,
        stop: Sequence[str],
        sampler: RowSampler,
        streamer: RowStreamer | None,
    ) -> list[list[int]]:
        """The rows decoded by the project's decoder, as ``generate`` would: every prompt prefilled in one
        pass, then one token per unfinished row and step, picked as the argmax of the sampler's scores.
        The sampler sees every row each step (a finished row's logits are zeros and its pick is
        ignored), so its :class:`Step` s line up with ``generate``'s. A row ends at a stop token, at the
        budget, or once its text holds a stop string. Returns each row's ids, padded to the longest
        with the pad id (``generate``'s output)."""
        import torch

        from mentorrl.rollout.decoders import make_decoder

        dec = make_decoder(self.model, kind, pad_token_id=self.pad_id, max_len=max_len)
        n, stop_ids = len(rows), set(self.stop_ids)
        new: list[list[int]] = [[] for _ in rows]
        done = [False] * n
        chunks = [list(r.prompt_ids) for r, _ in rows]
        try:
            dec.reset(n)
            for _ in range(budget):
                logits = dec.forward(chunks).float()  # generate's float32 scores
                if logits.shape[0] < n:  # the finished rows were not fed
                    full = logits.new_zeros(n, logits.shape[1])
                    full[[i for i, c in enumerate(chunks) if c]] = logits
                    logits = full
                picks = sampler(None, logits).argmax(dim=-1).tolist()
                tokens = [self.pad_id if done[i] else picks[i] for i in range(n)]
                for i, tok in enumerate(tokens):
                    if not done[i]:
                        new[i].append(tok)
                        done[i] = tok in stop_ids or (bool(stop) and self._stop_string(new[i], stop))
                if streamer is not None:
                    streamer.put(torch.tensor(tokens))
                if all(done):
                    break
                chunks = [[] if done[i] else [new[i][-1]] for i in range(n)]
        finally:
            dec.close()
        longest = max(len(r) for r in new)
        return [r + [self.pad_id] * (longest - len(r)) for r in new]

    def _stop_string(self, ids: list[int], stop: Sequence[str]) -> bool:
        """Whether the text of ``ids`` (no stop token yet) holds a stop string (as :meth:`_finish` cuts)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return any(s in text for s in stop)

    def _inputs(self, rows: list[tuple[GenRequest, int]], width: int, device: Any) -> tuple[Any, Any]:
        import torch

        pads = [width - len(r.prompt_ids) for r, _ in rows]
        ids = [[self.pad_id] * p + r.prompt_ids for p, (r, _) in zip(pads, rows)]
        mask = [[0] * p + [1] * len(r.prompt_ids) for p, (r, _) in zip(pads, rows)]
        return (torch.tensor(x, dtype=torch.long, device=device) for x in (ids, mask))

    def _generate_kwargs(self, budget: int, stop: Sequence[str], sampler: RowSampler) -> dict[str, Any]:
        from transformers import LogitsProcessorList

        kwargs: dict[str, Any] = dict(  # greedy over the sampler's scores; the checkpoint's other defaults neutralised
            max_new_tokens=budget,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            do_sample=False,
            num_beams=1,
            num_return_sequences=1,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            min_length=0,
            logits_processor=LogitsProcessorList([sampler]),
        )
        if stop:
            kwargs.update(stop_strings=list(stop), tokenizer=self.tokenizer)
        return kwargs

    def _sample(self, row: list[int], j: int, stop: Sequence[str], sampler: RowSampler, req: GenRequest) -> Sample:
        text, count, reason = self._finish(row, stop)
        steps = sampler.steps
        logprobs = [steps[t].entry(j, req.top_logprobs) for t in range(count)] if len(steps) >= count else None
        return Sample(row[:count], logprobs, text, reason)

    def _finish(self, row: list[int], stop: Sequence[str]) -> Turn:
        end = next((i for i, t in enumerate(row) if t in self.stop_ids), None)
        ids = row if end is None else row[:end]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:  # a stop string ended the row: what follows it is padding (a stop token when pad is one)
            while ids and ids[-1] == self.pad_id:
                ids = ids[:-1]
            return text[:cut], len(ids), "stop"
        if end is not None:
            return text, end + 1, "stop"
        return text, len(row), "length"


@dataclass
class Step:
    """One decoding step of a batch: per row the chosen id, its log-prob, and the top-k ids and log-probs."""

    chosen: list[int]
    logprob: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def entry(self, row: int, k: int) -> TokenLogprob:
        top = tuple(zip(self.top_ids[row][:k], self.top_logprobs[row][:k])) if k else ()
        return TokenLogprob(self.chosen[row], self.logprob[row], top)


class RowSampler:
    """A logits processor that samples inside a greedy ``generate``, each row on its own, and records
    each step's behaviour log-probs (:class:`Step`).

    A row's ``banned`` ids get -inf first. A sampled row's logits are then divided by its temperature,
    cut to its top-p nucleus (the rollouts' cut, :func:`mentorrl.rollout.sampling.nucleus`) and
    perturbed with Gumbel noise from its own generator, so the greedy argmax samples
    softmax(logits / T) over the nucleus (the Gumbel-max trick) and a row's draws depend on
    its generator alone, not on the rest of the batch. Greedy rows (no generator) are left alone.
    The recorded log-prob of the chosen token (the argmax of the returned scores, which ``generate``
    picks) is ``log_softmax(logits / T)`` of the logits it was given (T = 1 for a greedy row)."""

    def __init__(
        self,
        temperatures: Sequence[float],
        top_ps: Sequence[float],
        generators: Sequence[Any],
        device: Any,
        banned: Sequence[Sequence[int]] | None = None,
        top_k: int = 0,
    ):
        import torch

        self.rows = [r for r, g in enumerate(generators) if g is not None]
        self.generators = [generators[r] for r in self.rows]
        self.temperature = torch.tensor([[temperatures[r]] for r in self.rows], device=device)
        self.top_p = torch.tensor([[top_ps[r]] for r in self.rows], device=device)
        self.nucleus = any(top_ps[r] < 1.0 for r in self.rows)
        self.scale = torch.tensor([[t if t >= GREEDY_BELOW else 1.0] for t in temperatures], device=device)
        self.banned = [(r, list(ids)) for r, ids in enumerate(banned or []) if ids]
        self.top_k, self.steps = top_k, []  # steps: one Step per call

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        raw = scores
        if self.banned:
            scores = scores.clone()
            for r, ids in self.banned:
                scores[r, ids] = float("-inf")
        if self.rows:
            logits = scores[self.rows] / self.temperature
            if self.nucleus:
                from mentorrl.rollout.sampling import nucleus

                logits = nucleus(logits.log_softmax(dim=-1), self.top_p)  # the rollouts' cut (a row shift: same argmax)
            scores = scores.clone()
            scores[self.rows] = logits + _gumbel(logits.shape[1], self.generators)
        self._record(raw, scores)
        return scores

    def _record(self, raw: Any, scores: Any) -> None:
        chosen = scores.argmax(dim=-1)
        logp = (raw.float() / self.scale.to(raw.device)).log_softmax(dim=-1)
        lp = logp.gather(-1, chosen[:, None]).squeeze(-1)
        top_ids: list[list[int]] = [[] for _ in range(len(chosen))]
        top_lp: list[list[float]] = [[] for _ in range(len(chosen))]
        if self.top_k:
            vals, idx = logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)
            top_ids, top_lp = idx.tolist(), vals.tolist()
        self.steps.append(Step(chosen.tolist(), lp.tolist(), top_ids, top_lp))


class RowStreamer:
    """``generate``'s streamer (the decoder path calls it the same way): each step's token of each row of a streamed request goes onto that
    request's :attr:`GenRequest.events` as ``("token", sample index, id, TokenLogprob | None)``.
    A row's tokens after its turn ended (padding) are sent too; the reader knows where the turn ends."""

    def __init__(self, rows: Sequence[tuple[GenRequest, int]], sampler: RowSampler):
        self.rows, self.sampler, self.step = list(rows), sampler, 0

    def put(self, value: Any) -> None:
        if value.dim() > 1:  # the prompt, sent once before the first step
            return
        tokens, t = value.tolist(), self.step
        self.step += 1
        steps = self.sampler.steps
        for j, (req, i) in enumerate(self.rows):
            if req.events is not None:
                entry = steps[t].entry(j, req.top_logprobs) if t < len(steps) else None
                req.events.put(("token", i, tokens[j], entry))

    def end(self) -> None:
        pass


def row_generator(seed: int | None, index: int, device: Any) -> Any:
    """The ``torch.Generator`` of sample ``index`` of a request: seeded from (seed, index), or at random."""
    import torch

    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest(), "little"))
    return g


def _gumbel(size: int, generators: Sequence[Any]) -> Any:
    """One row of standard Gumbel noise (-log E, E ~ Exp(1)) per generator, drawn from it."""
    import torch

    rows = []
    for g in generators:
        e = torch.empty(size, device=g.device).exponential_(generator=g)
        rows.append(-e.clamp_min_(torch.finfo(e.dtype).tiny).log())
    return torch.stack(rows)


class Batcher:
    """One worker thread owns the model and serves the queued requests in batches.

    The worker takes the first pending request, then more for up to ``window_s`` or until
    ``max_batch`` rows (a request is ``n`` rows, a greedy one 1; one larger than ``max_batch``
    runs alone). The requests that can share a ``generate`` call (equal :attr:`GenRequest.key`)
    run together; an error reaches every request of its call, and the worker goes on.
    ``max_batch=1`` serves one request at a time."""

    def __init__(
        self, gen: PolicyGenerator, max_batch: int = DEFAULT_MAX_BATCH, window_s: float = DEFAULT_BATCH_WINDOW_MS / 1000
    ):
        if max_batch < 1 or window_s < 0:
            raise ValueError("max_batch must be at least 1 and window_s not negative")
        self.gen, self.max_batch, self.window_s = gen, max_batch, window_s
        self._queue: queue.Queue[GenRequest] = queue.Queue()
        self._held: GenRequest | None = None  # taken from the queue, but it did not fit the last batch
        self.stats = {"busy_s": 0.0, "calls": 0, "rows": 0}  # generate calls: wall seconds, count, rows
        threading.Thread(target=self._work, name="mentorrl-serve-batcher", daemon=True).start()

    def submit(self, req: GenRequest) -> list[Sample]:
        """Queue ``req`` and wait for its samples (an error from its batch is raised here)."""
        return self.enqueue(req).result()

    def enqueue(self, req: GenRequest) -> Future:
        """Queue ``req``; its future gets its samples (a streamed request's events come as they are made)."""
        self._queue.put(req)
        return req.future

    def _work(self) -> None:
        while True:
            for group in group_requests(self._collect()):
                self._run(group)

    def _collect(self) -> list[GenRequest]:
        batch = [self._held or self._queue.get()]
        self._held = None
        rows, deadline = batch[0].rows, time.monotonic() + self.window_s
        while rows < self.max_batch:
            try:
                req = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if rows + req.rows > self.max_batch:
                self._held = req
                break
            batch.append(req)
            rows += req.rows
        return batch

    def _run(self, group: list[GenRequest]) -> None:
        t0 = time.perf_counter()
        try:
            replies = self.gen.run(group)
        except Exception as e:  # each request of the call answers a 500
            for req in group:
                req.future.set_exception(e)
                if req.events is not None:
                    req.events.put(DONE)
            return
        finally:
            self.stats["busy_s"] += time.perf_counter() - t0
            self.stats["calls"] += 1
            self.stats["rows"] += sum(r.rows for r in group)
        for req, samples in zip(group, replies):
            req.future.set_result(samples)
            if req.events is not None:
                req.events.put(DONE)


def group_requests(batch: Sequence[GenRequest]) -> list[list[GenRequest]]:
    """``batch`` split into the groups that can share a ``generate`` call, in order of arrival."""
    groups: dict[tuple[int, tuple[str, ...]], list[GenRequest]] = {}
    for req in batch:
        groups.setdefault(req.key, []).append(req)
    return list(groups.values())


def _max_positions(model: Any, tokenizer: Any) -> int | None:
    """The model's context length, if it says."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(n, int) and n > 0:
        return n
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10**7 else None


__all__ = [
    "DECODERS",
    "DONE",
    "Batcher",
    "GenRequest",
    "PolicyGenerator",
    "RowSampler",
    "RowStreamer",
    "Sample",
    "Step",
    "TokenLogprob",
    "Turn",
    "group_requests",
    "row_generator",
]

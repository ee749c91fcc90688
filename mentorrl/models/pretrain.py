"""Pretraining the tiny base model on the environment's language (next-token loss on every token).

The corpus is generated, deterministically from ``PretrainSpec.seed``, from the training split only:

* ``transcript``: expert episodes on train tasks, rendered through the rollout contract (the same
  token ids SFT sees: prompt, tool calls, observations, final answers);
* ``schema``: the tool schemas -- the system turn with tool signatures and descriptions, and
  each tool's JSON schema;
* ``free_text`` / ``tool_session``: the environment's own generator (see
  :mod:`mentorrl.models.domain_text`): prose about seeded train-range worlds, and tool calls
  with their real observations on those worlds.

Documents are shuffled, joined with ``<|endoftext|>`` (the document separator of Qwen-family
pretraining; ``<|im_end|>`` already ends turns) and cut into full blocks of ``block_size`` tokens
(the tail is dropped). Blocks are drawn epoch by epoch in a seeded order; with one torch thread
the same spec gives the same weights bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mentorrl.contract import PAD, Control, message_pieces, system_text
from mentorrl.models.spec import PretrainSpec

# train-task seed of the corpus transcripts: apart from SFT's demonstrations (train tasks, seed cfg.seed)
CORPUS_TASK_SEED_OFFSET = 7_919
HELDOUT_EVAL_SEED = 0


@dataclass
class Corpus:
    docs: list[list[int]] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    world_seeds: list[int] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)

    def add(self, kind: str, ids: list[int]) -> None:
        if ids:
            self.docs.append(ids)
            self.kinds.append(kind)

    def summary(self) -> dict[str, Any]:
        by_kind: dict[str, dict[str, int]] = {}
        for kind, doc in zip(self.kinds, self.docs):
            k = by_kind.setdefault(kind, {"docs": 0, "tokens": 0})
            k["docs"] += 1
            k["tokens"] += len(doc)
        return {
            "docs": len(self.docs),
            "tokens": sum(map(len, self.docs)),
            "by_kind": by_kind,
            "worlds": len(self.world_seeds),
            "train_tasks": len(self.task_ids),
        }


def _contract(env: Any, tokenizer: Any, fmt: Any):
    from mentorrl.contract import contract_for_env

    return contract_for_env(tokenizer, env, prompt=fmt)


def transcript_ids(env_entry: Any, tokenizer: Any, tasks: list, fmt: Any = None) -> list[list[int]]:
    """Token ids of the expert's episode on each task, exactly as the contract renders them for SFT."""
    from mentorrl.rollout.episode import run_scripted_episode

    env, expert = env_entry.make_env(), env_entry.make_expert()
    try:
        contract = _contract(env, tokenizer, fmt)
        return [list(run_scripted_episode(contract, env, t, expert).token_ids) for t in tasks]
    finally:
        env.close()


def build_corpus(env_entry: Any, env_name: str, tokenizer: Any, spec: PretrainSpec, fmt: Any = None) -> Corpus:
    """The pretraining documents (token ids), a pure function of the tokenizer, ``spec`` and ``fmt``."""
    from mentorrl.contract import ChatEncoder
    from mentorrl.models.domain_text import DOMAIN_TEXT

    corpus = Corpus()
    enc = ChatEncoder(tokenizer)
    tasks = (
        env_entry.make_tasks().tasks(split="train", n=spec.transcripts, seed=spec.seed + CORPUS_TASK_SEED_OFFSET)
        if spec.transcripts
        else []
    )
    corpus.task_ids = [t.id for t in tasks]
    for ids in transcript_ids(env_entry, tokenizer, tasks, fmt):
        corpus.add("transcript", ids)

    env = env_entry.make_env()
    try:  # tool schemas: the system turn (with and without descriptions) and each tool's JSON schema
        tools = list(env.registry.tools.values())
        for described in (True, False):
            sigs = [t.signature(with_description=described) for t in tools]
            corpus.add("schema", enc.pieces(message_pieces("system", system_text(env.system_prompt, sigs))))
        for t in tools:
            corpus.add(
                "schema",
                enc.text(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})),
            )
    finally:
        env.close()

    gen = DOMAIN_TEXT.get(env_name)
    if gen is not None and spec.worlds:
        docs, corpus.world_seeds = gen(
            random.Random(f"pretrain/{env_name}/{spec.seed}"), spec.worlds, spec.corpus_version
        )
        for kind, pieces in docs:
            corpus.add(kind, enc.pieces([p if isinstance(p, Control) else str(p) for p in pieces]))
    return corpus


def separator_id(tokenizer: Any) -> int:
    return int(tokenizer.convert_tokens_to_ids(PAD))


def pack(docs: list[list[int]], block_size: int, sep_id: int, seed: int) -> torch.Tensor:
    """Shuffle ``docs`` (seeded), join them, each followed by ``sep_id``, and cut into full blocks.

    Returns a ``[n_blocks, block_size]`` long tensor; the incomplete tail is dropped."""
    order = list(range(len(docs)))
    random.Random(f"pack/{seed}").shuffle(order)
    stream: list[int] = []
    for i in order:
        stream += docs[i]
        stream.append(sep_id)
    n = len(stream) // block_size
    if n == 0:
        raise ValueError(f"the corpus ({len(stream)} tokens) is shorter than one block of {block_size}")
    return torch.tensor(stream[: n * block_size], dtype=torch.long).view(n, block_size)


def _lr_factor(step: int, spec: PretrainSpec) -> float:
    if spec.warmup_steps and step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    span = max(spec.steps - spec.warmup_steps, 1)
    progress = min(max(step - spec.warmup_steps, 0) / span, 1.0)
    return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def batch_order(n_blocks: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Block indices per step: seeded permutations, epoch after epoch."""
    rng = random.Random(f"blocks/{seed}")
    queue: list[int] = []
    out = []
    for _ in range(steps):
        batch = []
        while len(batch) < batch_size:
            if not queue:
                queue = list(range(n_blocks))
                rng.shuffle(queue)
            batch.append(queue.pop())
        out.append(batch)
    return out


def pretrain(
    model: Any, blocks: torch.Tensor, spec: PretrainSpec, log_every: int = 10, on_log: Any = None
) -> list[dict[str, float]]:
    """``spec.steps`` AdamW steps of next-token loss on every token of the packed blocks.

    Returns the loss curve: the mean loss over each window of ``log_every`` steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, spec))
    model.train()
    curve: list[dict[str, float]] = []
    window: list[float] = []
    t0 = time.perf_counter()
    for step, idx in enumerate(batch_order(blocks.shape[0], spec.steps, spec.batch_size, spec.seed)):
        x = blocks[idx]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        opt.step()
        sched.step()
        window.append(loss.item())
        if len(window) == log_every or step == spec.steps - 1:
            point = {
                "step": step + 1,
                "loss": sum(window) / len(window),
                "lr": sched.get_last_lr()[0],
                "elapsed_s": round(time.perf_counter() - t0, 2),
            }
            curve.append(point)
            if on_log is not None:
                on_log(point)
            window = []
    model.eval()
    return curve


@torch.no_grad()
def mean_token_loss(model: Any, docs: list[list[int]], pad_id: int, batch_size: int = 16) -> float:
    """Mean next-token loss over every token of ``docs`` (each scored on its own, no packing)."""
    model.eval()
    total, count = 0.0, 0
    for lo in range(0, len(docs), batch_size):
        chunk = docs[lo : lo + batch_size]
        T = max(map(len, chunk))
        ids = torch.full((len(chunk), T), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), T), dtype=torch.long)
        for b, d in enumerate(chunk):
            ids[b, : len(d)] = torch.tensor(d)
            mask[b, : len(d)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target, tmask = ids[:, 1:], mask[:, 1:].bool()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
        ).view(target.shape)
        total += float(nll[tmask].sum())
        count += int(tmask.sum())
    return total / max(count, 1)


def heldout_transcripts(env_entry: Any, tokenizer: Any, n: int, fmt: Any = None) -> list[list[int]]:
    """Expert transcripts of held-out-split tasks: scored, never trained on."""
    if n <= 0:
        return []
    tasks = env_entry.make_tasks().tasks(split="heldout", n=n, seed=HELDOUT_EVAL_SEED)
    return transcript_ids(env_entry, tokenizer, tasks, fmt)


def run_pretraining(
    env_entry: Any, env_name: str, tokenizer: Any, model: Any, spec: PretrainSpec, fmt: Any = None, on_log: Any = None
) -> dict[str, Any]:
    """Build the corpus, pack it, pretrain ``model`` in place; return the record for ``mentorrl_build.json``."""
    t0 = time.perf_counter()
    corpus = build_corpus(env_entry, env_name, tokenizer, spec, fmt)
    blocks = pack(corpus.docs, spec.block_size, separator_id(tokenizer), spec.seed)
    corpus_s = time.perf_counter() - t0
    evals = heldout_transcripts(env_entry, tokenizer, spec.eval_transcripts, fmt)
    pad = separator_id(tokenizer)
    before = mean_token_loss(model, evals, pad) if evals else None
    t1 = time.perf_counter()
    curve = pretrain(model, blocks, spec, on_log=on_log)
    train_s = time.perf_counter() - t1
    after = mean_token_loss(model, evals, pad) if evals else None
    tokens_seen = spec.steps * spec.batch_size * spec.block_size
    return {
        "corpus": {
            **corpus.summary(),
            "blocks": int(blocks.shape[0]),
            "block_size": spec.block_size,
            "packed_tokens": int(blocks.numel()),
            "sha256": hashlib.sha256(blocks.numpy().tobytes()).hexdigest()[:16],
        },
        "tokens_seen": tokens_seen,
        "epochs": round(tokens_seen / max(blocks.numel(), 1), 3),
        "loss_curve": curve,
        "loss_first": curve[0]["loss"] if curve else None,
        "loss_last": curve[-1]["loss"] if curve else None,
        "heldout_transcript_loss": {"n": len(evals), "before": before, "after": after},
        "corpus_s": round(corpus_s, 2),
        "train_s": round(train_s, 2),
        "torch_threads": torch.get_num_threads(),
    }


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]

"""The workspace every stage runs in (config, run directory, environment, tokenizer, contract,
data-parallel group) and the held-out evaluation of a model in it."""

from __future__ import annotations

import copy
import json
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from mentorrl.config import RunConfig, dump_config
from mentorrl.contract import RolloutContract, chat_template_for, contract_for_env
from mentorrl.envs import EnvEntry, get_env
from mentorrl.envs.base import check_stratifies, draw_tasks
from mentorrl.eval.metrics import summarize
from mentorrl.eval.sets import assert_trainable, assert_trainable_splits
from mentorrl.rollout.backends import configure as configure_rollout_backend
from mentorrl.rollout.runner import rollout_tasks
from mentorrl.train.rundir import MetricsLog
from mentorrl.trajectory import write_jsonl

@dataclass
class Workspace:
    """What every stage needs: config, run directory, environment, tokenizer and contract."""

    cfg: RunConfig
    run_dir: Path
    env_entry: EnvEntry
    tokenizer: Any = None
    contract: RolloutContract | None = None
    console: Console = field(default_factory=Console)
    show_progress: bool = True
    dp: Any = None  # the DataParallel group of a torchrun launch (mentorrl.train.distributed), or None

    @property
    def is_main(self) -> bool:
        """Whether this process writes: always in one process, rank 0 only under data parallel."""
        return self.dp is None or self.dp.is_main

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run by the writing process only, its result returned on every rank."""
        return fn() if self.dp is None else self.dp.on_main(fn)

    @property
    def metrics(self) -> MetricsLog:
        return MetricsLog(self.run_dir / "metrics.jsonl")

    def make_env(self):
        extra = {"latency": self.cfg.env.latency} if self.cfg.env.latency is not None else {}
        return self.env_entry.make_env(tool_timeout_s=self.cfg.env.tool_timeout_s, **extra)

    def bind_tokenizer(self, tokenizer) -> None:
        """Use ``tokenizer`` for the run; its chat template becomes the contract's for the run's prompt
        format (:func:`mentorrl.contract.chat_template_for`), so every checkpoint the run saves renders
        conversations with ``apply_chat_template`` as the policy was trained on them."""
        tokenizer.chat_template = chat_template_for(self.cfg.prompt)
        self.tokenizer = tokenizer
        env = self.make_env()
        try:
            self.contract = contract_for_env(tokenizer, env, self.cfg.sampling, self.cfg.limits, self.cfg.prompt)
        finally:
            env.close()

    def tasks(self, split: str, n: int, seed: int, stratified: bool = False):
        return draw_tasks(self.env_entry.make_tasks(), split, n, seed, stratified=stratified)

    def eval_tasks(self, split: str, n: int):
        """The evaluation tasks of ``split`` (``eval.seed``; stratified when ``eval.stratify``, as the
        task source stratifies that split: orders keeps golden's curated cycle)."""
        return self.tasks(split, n, self.cfg.eval.seed, stratified=self.cfg.eval.stratify)

    def train_tasks(self, n: int, seed: int):
        """Tasks for a training stage, from ``cfg.train_split``; refuses the hidden evaluation set."""
        assert_trainable_splits([self.cfg.train_split])
        tasks = self.tasks(self.cfg.train_split, n, seed)
        assert_trainable(tasks)
        return tasks

    def progress(self):
        if not self.show_progress:
            return nullcontext(None)
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            transient=False,
        )


def open_workspace(cfg: RunConfig, show_progress: bool = True, dp=None) -> Workspace:
    """The run's workspace; with ``dp`` (a data-parallel rank) only rank 0 writes and shows progress."""
    run_dir = Path(cfg.run_dir)
    main = dp is None or dp.is_main
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    configure_rollout_backend(cfg.rollout)  # rollout.backend: what rollout_tasks decodes with
    entry = get_env(cfg.env.name)
    if cfg.eval.stratify:
        check_stratifies(entry.make_tasks())  # before the first step
    return Workspace(cfg=cfg, run_dir=run_dir, env_entry=entry, show_progress=show_progress and main,
                     console=Console() if main else Console(quiet=True), dp=dp)


def frozen_copy(model):
    """A copy of ``model`` in eval mode with no gradients: a reference policy fixed at a stage's start."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def load_weights_into(model, ckpt: Path) -> None:
    """Copy the weights of the Hugging Face checkpoint ``ckpt`` into ``model`` (same architecture)."""
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(ckpt, dtype=next(model.parameters()).dtype)
    model.load_state_dict(src.state_dict())



def heldout_check(ws: Workspace, model, n: int) -> float:
    """Held-out success of the current weights on ``n`` tasks (the same tasks at every check of a run)."""
    tasks = ws.eval_tasks(ws.cfg.eval.split, n)
    trajs = rollout_tasks(model, eval_contract(ws), ws.make_env, tasks, seed=ws.cfg.eval.seed,
                          batch_size=ws.cfg.eval.batch_size, weights=ws.cfg.reward)
    return float(summarize(trajs)["success"])


def eval_contract(ws: Workspace) -> RolloutContract:
    """The rollout contract with the evaluation temperature, when one is configured."""
    t = ws.cfg.eval.temperature
    if t is None:
        return ws.contract
    return replace(ws.contract, sampling=ws.contract.sampling.model_copy(update={"temperature": t}))


def evaluate(ws: Workspace, model, label: str, resume: bool = False, split: str | None = None) -> dict[str, Any]:
    """Roll out ``eval.num_tasks`` tasks of ``split`` (default ``eval.split``, the held-out set);
    writes eval_<label>.json and eval_<label>.jsonl into the run dir."""
    cfg, e = ws.cfg, ws.cfg.eval
    split = split or e.split
    out_json = ws.run_dir / f"eval_{label}.json"
    if resume and out_json.exists():
        return json.loads(out_json.read_text())
    contract = eval_contract(ws)
    tasks = ws.eval_tasks(split, e.num_tasks)
    with ws.progress() as prog:
        bar = prog.add_task(f"eval {label}", total=len(tasks), info="") if prog else None
        trajs = rollout_tasks(
            model, contract, ws.make_env, tasks, seed=e.seed, batch_size=e.batch_size, weights=cfg.reward,
            on_batch=(lambda n: prog.update(bar, advance=n)) if prog else None,
        )
    write_jsonl(ws.run_dir / f"eval_{label}.jsonl", trajs)
    summary = {"label": label, "split": split, "eval_seed": e.seed, "stratified": e.stratify, **summarize(trajs)}
    out_json.write_text(json.dumps(summary, indent=2))
    return summary

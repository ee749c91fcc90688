"""The workspace every stage runs in (config, run directory, environment, tokenizer, contract,
data-parallel group) and the held-out evaluation of a model in it."""

from __future__ import annotations

import copy
import json
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from pydantic import BaseModel
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from mentorrl.chat_templates import PROMPT_RECORD, native_chat_for
from mentorrl.config import ConfigError, RunConfig, SFTConfig, TeacherBuildConfig, dump_config
from mentorrl.contract import RolloutContract, chat_template_for, contract_for_env
from mentorrl.core.checksums import require_manifest
from mentorrl.envs import EnvEntry, env_factory, resolve_env
from mentorrl.envs.base import check_stratifies, draw_family_tasks, draw_tasks
from mentorrl.eval.metrics import summarize
from mentorrl.eval.sets import assert_trainable, assert_trainable_splits
from mentorrl.models.device import resolve_device, rollout_backend_args
from mentorrl.rollout import BackendChoice, Rollout
from mentorrl.train.memory import choose_malloc_mmap_threshold, set_malloc_mmap_threshold
from mentorrl.train.parallelism import Parallelism, choose_parallelism, cpu_cores, write_parallelism
from mentorrl.train.progress import count_progress
from mentorrl.train.rundir import MetricsLog
from mentorrl.trajectory import write_jsonl


@dataclass
class Workspace:
    """What every stage needs: config, run directory, environment, tokenizer and contract, and the
    run's :class:`~mentorrl.rollout.Rollout` (``ws.rollout``, built once the contract is known;
    :meth:`close` frees its engine)."""

    cfg: RunConfig
    run_dir: Path
    env_entry: EnvEntry
    tokenizer: Any = None
    contract: RolloutContract | None = None
    console: Console = field(default_factory=Console)
    show_progress: bool = True
    dp: Any = None  # the DataParallel group of a torchrun launch (mentorrl.train.distributed), or None
    _rollout: Rollout | None = field(default=None, init=False, repr=False)
    _ray: Any = field(default=None, init=False, repr=False)  # the Ray rollout actors of ray_rollouts(), or None

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
        return env_factory(self.env_entry, self.cfg.env)()

    @property
    def rollout(self) -> Rollout:
        """The run's rollout: its contract, environments (:func:`~mentorrl.envs.env_factory`), reward
        weights and the ``rollout:`` section's backend. Built on first use; a new contract (a new
        tokenizer bound) keeps the backend and its engine."""
        r = self._rollout
        if r is None or r.contract is not self.contract:
            if self.contract is None:
                raise RuntimeError("the workspace has no rollout contract yet (bind_tokenizer first)")
            r = (
                Rollout(
                    self.contract,
                    env_factory(self.env_entry, self.cfg.env),
                    self.cfg.reward,
                    BackendChoice(*rollout_backend_args(self.cfg)),
                )
                if r is None
                else r.with_contract(self.contract)
            )
            self._rollout = r
        return r

    def ray_rollouts(self, model):
        """The Ray rollout actors (:class:`~mentorrl.distributed.ray_workers.RayRollouts`) that roll
        ``model`` out with this workspace's rollout under ``distributed.backend: ray``: started on first
        use; another model (or contract) closes them and starts a new set."""
        from mentorrl.distributed.ray_workers import RayRollouts

        pool, rollout = self._ray, self.rollout
        if pool is None or pool.model is not model or pool.rollout_spec.contract is not rollout.contract:
            self.close_ray_rollouts()
            self._ray = pool = RayRollouts(self.cfg.distributed, model, rollout.spec())
        return pool

    def close_ray_rollouts(self) -> None:
        """Release the Ray rollout actors of :meth:`ray_rollouts`, if any (kept idle for the next pool)."""
        pool, self._ray = self._ray, None
        if pool is not None:
            pool.close()

    def close(self) -> None:
        """Free what the workspace holds: its Ray rollout actors and its rollout's engine."""
        self.close_ray_rollouts()
        r, self._rollout = self._rollout, None
        if r is not None:
            r.close()

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def bind_tokenizer(self, tokenizer) -> None:
        """Use ``tokenizer`` for the run. A checkpoint whose chat template renders tools in a known family
        keeps it, and the contract renders with it (:func:`mentorrl.chat_templates.native_chat_for`,
        ``prompt.tool_format``); otherwise its chat template becomes the contract's for the run's prompt
        format (:func:`mentorrl.contract.chat_template_for`). Either way every checkpoint the run saves
        renders conversations with ``apply_chat_template`` as the policy was trained on them."""
        env = self.make_env()
        try:
            chat = native_chat_for(tokenizer, env, self.cfg.prompt)
            if chat is None:
                tokenizer.chat_template = chat_template_for(self.cfg.prompt)
            elif chat.prefix_problem:
                self.console.print(f"[yellow]chat template ({chat.name}): {chat.prefix_problem}[/yellow]")
            if chat is not None:  # travels with every checkpoint's tokenizer: serve renders as the run trained
                tokenizer.init_kwargs[PROMPT_RECORD] = {
                    "tool_format": chat.name,
                    "system_turn": self.cfg.prompt.system_turn,
                    "native_tools": self.cfg.prompt.native_tools,
                }
            self.tokenizer = tokenizer
            self.contract = contract_for_env(
                tokenizer, env, self.cfg.sampling, self.cfg.limits, self.cfg.prompt, chat=chat
            )
        finally:
            env.close()

    def tasks(self, split: str, n: int, seed: int, stratified: bool = False):
        return draw_tasks(self.env_entry.make_tasks(), split, n, seed, stratified=stratified)

    def eval_tasks(self, split: str, n: int):
        """The evaluation tasks of ``split`` (``eval.seed``; stratified when ``eval.stratify``, as the
        task source stratifies that split: orders keeps golden's curated cycle)."""
        return self.tasks(split, n, self.cfg.eval.seed, stratified=self.cfg.eval.stratify)

    def train_tasks(self, n: int, seed: int, families: Sequence[str] | None = None):
        """Tasks for a training stage, from ``cfg.train_split``; refuses the hidden evaluation set. With
        ``families``: ``n`` tasks of those families only (:func:`~mentorrl.envs.base.draw_family_tasks`)."""
        assert_trainable_splits([self.cfg.train_split])
        if families:
            tasks = draw_family_tasks(self.env_entry.make_tasks(), self.cfg.train_split, n, seed, families)
        else:
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


def auto_parallelism(cfg: RunConfig, ranks: int = 1) -> Parallelism | None:
    """``threads: auto``'s choice for this machine and ``cfg`` (:mod:`mentorrl.train.parallelism`); under
    ``distributed.backend: ray`` it also sets ``distributed.rollout_workers`` unless the config set it. None
    for a fixed thread count."""
    if cfg.threads != "auto":
        return None
    device = resolve_device(cfg.model.device).type
    plan = choose_parallelism(cpu_cores(), device, tuple(cfg.recipe), False, ranks)  # an overlapped stage: its own
    if cfg.distributed.backend == "ray" and "rollout_workers" not in cfg.distributed.model_fields_set:
        cfg.distributed.rollout_workers = plan.rollout_workers
    return plan


def stage_optims(cfg: RunConfig) -> dict[str, Any]:
    """Each recipe stage's ``optim`` config, by stage (its section is the config field of its name;
    stages without one left out)."""
    optims = {name: getattr(getattr(cfg, name, None), "optim", None) for name in cfg.recipe}
    return {name: o for name, o in optims.items() if o is not None}


def apply_malloc_threshold(cfg: RunConfig, main: bool) -> int | None:
    """Set the run's glibc mmap threshold (:func:`choose_malloc_mmap_threshold`); the choice is printed
    on the main rank, and why not where it cannot be applied. The bytes applied, or None."""
    nbytes, reason = choose_malloc_mmap_threshold(cfg.malloc_mmap_threshold, stage_optims(cfg))
    why = set_malloc_mmap_threshold(nbytes)
    if main and nbytes is not None:
        line = (
            f"malloc_mmap_threshold {nbytes}: {reason}" if why is None else f"malloc_mmap_threshold not applied: {why}"
        )
        Console(stderr=True, soft_wrap=True).print(line, markup=False, highlight=False)
    return nbytes if why is None else None


def open_workspace(cfg: RunConfig, show_progress: bool = True, dp=None) -> Workspace:
    """The run's workspace; with ``dp`` (a data-parallel rank) only rank 0 writes and shows progress."""
    run_dir = Path(cfg.run_dir)
    main = dp is None or dp.is_main
    plan = auto_parallelism(cfg, dp.world_size if dp is not None else 1)  # before config.yaml: it may set workers
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        if plan is not None:
            write_parallelism(run_dir, plan)
            Console().print(plan.line(), markup=False, highlight=False)
    if cfg.threads:
        torch.set_num_threads(plan.threads if plan is not None else cfg.threads)
    apply_malloc_threshold(cfg, main)  # before the policy's tensors are allocated
    entry = resolve_env(cfg.env)
    if cfg.eval.stratify:
        check_stratifies(entry.make_tasks())  # before the first step
    check_families(cfg, entry)  # before the first step
    return Workspace(
        cfg=cfg,
        run_dir=run_dir,
        env_entry=entry,
        show_progress=show_progress and main,
        console=Console() if main else Console(quiet=True),
        dp=dp,
    )


def family_filters(node: Any, where: str) -> list[tuple[str, list[str]]]:
    """(dotted field, families) of every family filter set in config ``node`` (at field ``where``): an
    SFT section's ``families`` and a local teacher's ``build.families``, however deep in a stage's section."""
    if isinstance(node, (SFTConfig, TeacherBuildConfig)):
        return [(f"{where}.families", node.families)] if node.families else []
    if isinstance(node, BaseModel):
        return [f for k in type(node).model_fields for f in family_filters(getattr(node, k), f"{where}.{k}")]
    if isinstance(node, (list, tuple)):
        return [f for i, v in enumerate(node) for f in family_filters(v, f"{where}.{i}")]
    return []


def check_families(cfg: RunConfig, entry: EnvEntry) -> None:
    """Every family filter of the recipe's stages names families of the environment's task source (where
    the source says which: its ``families``); else a :class:`ConfigError` naming the field. A source that
    does not say is checked when the stage draws its tasks."""
    filters = [f for stage in dict.fromkeys(cfg.recipe) for f in family_filters(getattr(cfg, stage, None), stage)]
    known = getattr(entry.make_tasks(), "families", None) if filters else None
    for field_name, families in filters if known is not None else ():
        unknown = [f for f in families if f not in known]
        if unknown:
            raise ConfigError(
                f"{field_name}: unknown task famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                f"environment {cfg.env.name!r} has {', '.join(known)}"
            )


def frozen_copy(model):
    """A copy of ``model`` in eval mode with no gradients: a reference policy fixed at a stage's start.

    A LoRA policy's frozen base weights are shared with the copy, not copied: only the adapters train, so
    the base never changes and the reference adds one copy of the adapters, not of the model."""
    from mentorrl.rollout.adapters import is_adapted

    memo = {id(p): p for p in model.parameters() if not p.requires_grad} if is_adapted(model) else {}
    ref = copy.deepcopy(model, memo).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def load_weights_into(model, ckpt: Path, verify: bool = True) -> None:
    """Copy the weights of the Hugging Face checkpoint ``ckpt`` into ``model`` (same architecture), once
    ``ckpt`` passes its checksum manifest, which it must have (:func:`~mentorrl.core.checksums.require_manifest`;
    ``verify=False`` only where the caller has just verified it). A LoRA policy (``model.lora``) takes the
    adapter saved there (:func:`mentorrl.models.lora.load_adapter_weights`)."""
    from transformers import AutoModelForCausalLM

    from mentorrl.models.lora import is_adapted, load_adapter_weights

    if verify:
        require_manifest(Path(ckpt))
    if is_adapted(model):
        return load_adapter_weights(model, ckpt)

    src = AutoModelForCausalLM.from_pretrained(ckpt, dtype=next(model.parameters()).dtype)
    model.load_state_dict(src.state_dict())


def heldout_check(ws: Workspace, model, n: int) -> float:
    """Held-out success of the current weights on ``n`` tasks (the same tasks at every check of a run);
    under a launch of several ranks a collective call, as :func:`eval_trajectories` is."""
    tasks = ws.eval_tasks(ws.cfg.eval.split, n)
    return float(summarize(eval_trajectories(ws, model, tasks))["success"])


def shares_evaluation(ws: Workspace) -> bool:
    """Whether this run's evaluations are dealt over its ranks: a data-parallel (DDP) launch of more
    than one rank, every rank holding the whole model."""
    dp = ws.dp
    return dp is not None and dp.world_size > 1 and dp.strategy == "ddp"


def eval_trajectories(ws: Workspace, model, tasks: list, on_batch: Callable[[int], None] | None = None) -> list:
    """The evaluation rollout of ``tasks`` (eval settings), on every rank of a launch (a collective call).

    One process streams them (:meth:`Rollout.stream`: ``eval.batch_size`` in flight), task ``i``
    sampling from a generator seeded by ``(eval.seed, i)``. A data-parallel launch
    (:func:`shares_evaluation`) deals the tasks over its ranks (rank ``r`` streams tasks ``r``, ``r + W``,
    ...; each keeps its index, so its seed) and gathers them in order on every rank: the trajectories one
    process rolls out (up to the float noise of which rows share a decoder pass), in a fraction of the
    time. Other launches (FSDP2) roll out on rank 0 and broadcast."""
    e, ro = ws.cfg.eval, eval_rollout(ws)
    if not shares_evaluation(ws):
        return ws.on_main(lambda: ro.stream(model, tasks, seed=e.seed, slots=e.batch_size, on_batch=on_batch))
    dp = ws.dp
    mine = list(range(dp.rank, len(tasks), dp.world_size))
    done = ro.stream(model, [tasks[i] for i in mine], seed=e.seed, slots=e.batch_size, indices=mine, on_batch=on_batch)
    parts: dict[int, Any] = {}
    for part in dp.all_gather(dict(zip(mine, done))):
        parts.update(part)
    if on_batch is not None:  # the other ranks' tasks, on this rank's progress
        on_batch(len(tasks) - len(mine))
    return [parts[i] for i in range(len(tasks))]


def eval_rollout(ws: Workspace) -> Rollout:
    """The workspace's rollout at the evaluation temperature, when one is configured (same backend)."""
    return ws.rollout.with_temperature(ws.cfg.eval.temperature)


def evaluate(ws: Workspace, model, label: str, resume: bool = False, split: str | None = None) -> dict[str, Any]:
    """Roll out ``eval.num_tasks`` tasks of ``split`` (default ``eval.split``, the held-out set);
    rank 0 writes eval_<label>.json and eval_<label>.jsonl into the run dir. Called on every rank of a
    launch (:func:`eval_trajectories`); each returns the summary."""
    e = ws.cfg.eval
    split = split or e.split
    out_json = ws.run_dir / f"eval_{label}.json"
    tasks = ws.eval_tasks(split, e.num_tasks)
    done = ws.on_main(lambda: json.loads(out_json.read_text()) if resume and out_json.exists() else None)
    if done is not None and (done.get("split"), done.get("eval_seed"), done.get("n")) == (split, e.seed, len(tasks)):
        return done  # the same evaluation; another task count, split or seed is run again
    with count_progress(ws, f"eval {label}", len(tasks)) as advance:
        trajs = eval_trajectories(ws, model, tasks, on_batch=advance)
    summary = {"label": label, "split": split, "eval_seed": e.seed, "stratified": e.stratify, **summarize(trajs)}

    def write() -> None:
        write_jsonl(ws.run_dir / f"eval_{label}.jsonl", trajs)
        out_json.write_text(json.dumps(summary, indent=2))

    ws.on_main(write)
    return summary

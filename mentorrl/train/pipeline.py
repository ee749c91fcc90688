"""Recipes composed from stages: building the base model, and the demo (SFT -> eval -> GRPO -> eval)."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from mentorrl.config import RunConfig
from mentorrl.eval.plots import plot_rl_curves
from mentorrl.models.build import ModelSpec, init_model, load_policy
from mentorrl.models.corpus import expert_transcripts
from mentorrl.train.stages import Workspace, evaluate, grpo_stage, open_workspace, sft_stage


def build_tiny_model(env_entry, out_dir: Path, spec: ModelSpec, corpus_tasks: int, seed: int = 0, fmt=None) -> Path:
    """Tokenizer trained on expert transcripts of train tasks + a fresh Qwen2-architecture model."""
    if (out_dir / "model.safetensors").exists() and (out_dir / "tokenizer.json").exists():
        return out_dir
    env, expert = env_entry.make_env(), env_entry.make_expert()
    try:
        corpus = list(expert_transcripts(env, expert, env_entry.make_tasks().tasks(split="train", n=corpus_tasks, seed=seed), fmt))
    finally:
        env.close()
    return init_model(out_dir, corpus, spec)


def base_model_dir(ws: Workspace) -> Path:
    if ws.cfg.model.path is not None:
        path = Path(ws.cfg.model.path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path {path} is not a Hugging Face checkpoint directory (no config.json)")
        return path
    return build_tiny_model(ws.env_entry, ws.run_dir / "base_model", ws.cfg.model.spec, ws.cfg.model.tokenizer_corpus_tasks, ws.cfg.seed, ws.cfg.prompt)


def _fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def before_after_table(rows: dict[str, dict[str, Any]]) -> Table:
    t = Table(title="Held-out evaluation")
    for col in ("checkpoint", "n", "task success", "95% CI", "tool success", "mean turns"):
        t.add_column(col, justify="right" if col != "checkpoint" else "left")
    for label, s in rows.items():
        lo, hi = s["success_ci95"]
        t.add_row(label, str(s["n"]), _fmt_pct(s["success"]), f"[{_fmt_pct(lo)}, {_fmt_pct(hi)}]",
                  _fmt_pct(s["tool_success"]), f"{s['mean_turns']:.2f}")
    return t


def run_demo(cfg: RunConfig, resume: bool = False, show_progress: bool = True) -> dict[str, Any]:
    t0 = time.perf_counter()
    ws = open_workspace(cfg, show_progress=show_progress)
    con = ws.console
    con.rule("[bold]mentorrl demo")
    model_dir = base_model_dir(ws)
    tokenizer, model = load_policy(model_dir)
    ws.bind_tokenizer(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    con.print(f"model: {model_dir} ({n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}), run dir: {ws.run_dir}")

    con.rule("SFT on expert demonstrations")
    sft_stage(ws, model, resume=resume)
    before = evaluate(ws, model, "sft", resume=resume)
    con.print(f"held-out success after SFT: {_fmt_pct(before['success'])}")

    con.rule("GRPO")
    ref = None
    if cfg.grpo.kl_coef > 0:
        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
    grpo_stage(ws, model, ref_model=ref, resume=resume)
    after = evaluate(ws, model, "grpo", resume=resume)

    rows = {"SFT": before, "SFT + GRPO": after}
    con.print(before_after_table(rows))
    records = ws.metrics.read("grpo")
    plot = plot_rl_curves(records, ws.run_dir / "curves.png", {"sft": before["success"], "grpo": after["success"]})
    delta = after["success"] - before["success"]
    con.print(f"GRPO changed held-out success by {100 * delta:+.1f} points; plot: {plot}; "
              f"total time {time.perf_counter() - t0:.0f}s")
    return {"before": before, "after": after, "plot": str(plot), "run_dir": str(ws.run_dir)}

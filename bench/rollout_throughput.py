"""Rollout throughput: the batched engine vs one trajectory at a time with ``model.generate``.

Both paths run in this one process, on the same held-out tasks, with the same model, the
same rollout contract (template, stop tokens, sampling, limits) and the same
:class:`mentorrl.rollout.episode.Episode` state machine, so the only difference is how
tokens are decoded:

* batched:    ``RolloutEngine(model, contract).run(episodes, seed)``: every live
  trajectory advances in one forward pass per step, KV cache kept across turns;
* sequential: for each task, each policy turn is one Hugging Face ``model.generate`` call
  on all ids so far (the prompt, earlier turns and observations), then the turn goes
  through ``Episode.add_policy_turn`` / ``run_tool`` / ``add_observation``.

Prints generated (policy) tokens per second for each path and their ratio.

    python bench/rollout_throughput.py                      # tiny model + short SFT, 64 tasks
    python bench/rollout_throughput.py --model runs/demo/sft/final --tasks 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mentorrl.config import OptimConfig, load_config  # noqa: E402
from mentorrl.contract import ContractLimits, PromptFormat, SamplingParams, contract_for_env  # noqa: E402
from mentorrl.envs import get_env  # noqa: E402
from mentorrl.eval.metrics import summarize  # noqa: E402
from mentorrl.models.build import load_policy  # noqa: E402
from mentorrl.rollout.engine import RolloutEngine  # noqa: E402
from mentorrl.rollout.episode import Episode  # noqa: E402
from mentorrl.rollout.runner import expert_demonstrations  # noqa: E402
from mentorrl.train.learner import Learner  # noqa: E402
from mentorrl.train.models_init import build_tiny_model  # noqa: E402

ENV_NAME = "orders"
# The contract of the demo recipe (the model it trains is the default model here).
_DEMO = load_config(Path(__file__).resolve().parent.parent / "mentorrl" / "configs" / "demo.yaml")
SAMPLING: SamplingParams = _DEMO.sampling
LIMITS: ContractLimits = _DEMO.limits
FMT: PromptFormat = _DEMO.prompt
DEFAULT_MODEL = Path("runs/demo/sft/final")


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


# ------------------------------------------------------------------ model ---
def prepare_model(args, entry, con: Console):
    """(tokenizer, model, description). ``--model``, else runs/demo/sft/final, else tiny model + short SFT."""
    model_dir = Path(args.model) if args.model else None
    if model_dir is None:
        for cand in (DEFAULT_MODEL, Path(__file__).resolve().parent.parent / DEFAULT_MODEL):
            if (cand / "config.json").exists():
                model_dir = cand
                break
    if model_dir is not None:
        if not (model_dir / "config.json").exists():
            sys.exit(f"--model {model_dir}: not a Hugging Face checkpoint directory (no config.json)")
        tok, model = load_policy(model_dir)
        return tok, model, str(model_dir)

    cache = (
        None if args.no_cache else Path(args.cache_dir) / f"tiny-sft{args.sft_steps}-demos{args.demos}-seed{args.seed}"
    )
    if cache is not None and (cache / "DONE").exists():
        tok, model = load_policy(cache)
        return tok, model, f"cached tiny model + {args.sft_steps} SFT steps ({cache})"

    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="mentorrl-bench-"))
    base = build_tiny_model(entry, tmp / "base", _DEMO.model.spec, corpus_tasks=200, seed=0, fmt=FMT)
    tok, model = load_policy(base)
    contract = _contract(tok, entry)
    demos = expert_demonstrations(
        contract, entry.make_env, entry.make_expert(), entry.make_tasks().tasks("train", n=args.demos, seed=args.seed)
    )
    if not demos:
        sys.exit("the scripted expert produced no verified demonstrations")
    learner = Learner(model, OptimConfig(lr=3e-3, warmup_steps=5), contract.pad_token_id, SAMPLING.temperature)
    loss = float("nan")
    con.print(
        f"[dim]no cached model: building the tiny model and running {args.sft_steps} SFT steps "
        f"(batch 32; slow on a small CPU, cached in {cache} afterwards)[/dim]"
    )
    for step in range(args.sft_steps):
        rng = random.Random(args.seed * 1_000_003 + step)
        batch = [demos[i] for i in rng.sample(range(len(demos)), min(32, len(demos)))]
        loss = learner.sft_step(batch).get("loss", float("nan"))
    model.eval()
    desc = f"tiny model + {args.sft_steps} SFT steps on {len(demos)} demos (final loss {loss:.3f})"
    for out in (cache, Path(args.save_model) if args.save_model else None):
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(out, safe_serialization=True)
            tok.save_pretrained(out)
            (out / "DONE").write_text(desc)
    shutil.rmtree(tmp, ignore_errors=True)
    con.print(f"[dim]prepared {desc} in {time.perf_counter() - t0:.1f}s[/dim]")
    return tok, model, desc


def _contract(tok, entry):
    env = entry.make_env()
    try:
        return contract_for_env(tok, env, SAMPLING, LIMITS, FMT)
    finally:
        env.close()


# ---------------------------------------------------------------- batched ---
def run_batched(model, contract, entry, tasks, seed: int):
    envs = [entry.make_env() for _ in tasks]
    try:
        eps = [Episode(contract, env, t) for env, t in zip(envs, tasks)]
        engine = RolloutEngine(model, contract)
        t0 = time.perf_counter()
        trajs = engine.run(eps, seed=seed)
        wall = time.perf_counter() - t0
    finally:
        for env in envs:
            env.close()
    return trajs, wall, dict(engine.last_stats)


# ------------------------------------------------------------- sequential ---
def generate_turn(model, contract, ids: list[int], max_new: int) -> tuple[list[int], list[float], bool]:
    """One policy turn with ``model.generate``; ids up to and including the first stop token."""
    s = contract.sampling
    greedy = s.temperature == 0
    kw = (
        dict(do_sample=False)
        if greedy
        else dict(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    )
    out = model.generate(
        input_ids=torch.tensor([ids], device=next(model.parameters()).device),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=next(model.parameters()).device),
        max_new_tokens=max_new,
        eos_token_id=contract.stop_token_ids,
        pad_token_id=contract.pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
        **kw,
    )
    gen = out.sequences[0, len(ids) :].tolist()
    stops = set(contract.stop_token_ids)
    cut = next((k + 1 for k, t in enumerate(gen) if t in stops), len(gen))
    gen = gen[:cut]
    # behaviour log-probs, the engine's convention: log_softmax(raw logits / T) at the chosen token
    temp = s.temperature if s.temperature > 0 else 1.0
    logits = torch.stack(out.logits[:cut], dim=0)[:, 0, :].float()
    lp = torch.log_softmax(logits / temp, dim=-1).gather(-1, torch.tensor(gen, device=logits.device)[:, None])
    return gen, lp[:, 0].tolist(), bool(gen) and gen[-1] in stops


def run_sequential(model, contract, entry, tasks, seed: int):
    torch.manual_seed(seed)
    env = entry.make_env()
    trajs, gen_calls = [], 0
    try:
        t0 = time.perf_counter()
        for task in tasks:
            ep = Episode(contract, env, task)
            ep.start()
            while True:
                max_new = min(contract.sampling.max_new_tokens, ep.tokens_left())
                gen, lps, stopped = generate_turn(model, contract, ep.ids, max_new)
                gen_calls += 1
                action = ep.add_policy_turn(gen, lps, stopped=stopped)
                if action is None:
                    break
                if ep.add_observation(ep.run_tool(action)) is None:
                    break
            trajs.append(ep.finish())
        wall = time.perf_counter() - t0
    finally:
        env.close()
    return trajs, wall, {"generate_calls": gen_calls}


# ------------------------------------------------------------------- main ---
def path_summary(trajs, wall: float, extra: dict) -> dict:
    s = summarize(trajs)
    toks = sum(t.num_policy_tokens for t in trajs)
    return {
        "trajectories": len(trajs),
        "generated_tokens": toks,
        "wall_s": wall,
        "tokens_per_s": toks / wall if wall > 0 else 0.0,
        "mean_turns": s["mean_turns"],
        "task_success": s["success"],
        "tool_calls": s["tool_calls"],
        "tool_success": s["tool_success"],
        "finish_reasons": {
            r: sum(t.finish_reason == r for t in trajs) for r in sorted({t.finish_reason for t in trajs})
        },
        **extra,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=64, help="held-out tasks rolled out by each path (default 64)")
    p.add_argument(
        "--model",
        default=None,
        help="HF checkpoint dir with a ChatML tokenizer "
        f"(default: {DEFAULT_MODEL} if it exists, else the tiny model + a short SFT)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--sft-steps", type=int, default=40, help="SFT steps for the tiny default model")
    p.add_argument("--demos", type=int, default=300, help="expert demos for that SFT")
    p.add_argument("--save-model", default=None, help="save the SFT'd tiny model here (reuse with --model)")
    p.add_argument("--cache-dir", default="runs/bench", help="where the prepared tiny model is cached")
    p.add_argument("--no-cache", action="store_true", help="always rebuild the tiny model")
    p.add_argument("--warmup-tasks", type=int, default=2)
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    args = p.parse_args(argv)

    _quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    con = Console(width=max(Console().width, 112))
    entry = get_env(ENV_NAME)
    tok, model, model_desc = prepare_model(args, entry, con)
    model.eval()
    contract = _contract(tok, entry)
    tasks = entry.make_tasks().tasks("heldout", n=args.tasks, seed=args.seed)
    n_params = sum(x.numel() for x in model.parameters())
    con.print(
        f"model: {model_desc} ({n_params / 1e6:.2f}M params); {len(tasks)} held-out {ENV_NAME} tasks; "
        f"torch threads {torch.get_num_threads()}; sampling {SAMPLING.model_dump()}; limits {LIMITS.model_dump()}"
    )

    with torch.inference_mode():
        if args.warmup_tasks:
            warm = entry.make_tasks().tasks("train", n=args.warmup_tasks, seed=args.seed + 1)
            run_batched(model, contract, entry, warm, seed=args.seed + 1)
            run_sequential(model, contract, entry, warm, seed=args.seed + 1)
        b_trajs, b_wall, b_extra = run_batched(model, contract, entry, tasks, seed=args.seed)
        s_trajs, s_wall, s_extra = run_sequential(model, contract, entry, tasks, seed=args.seed)

    res_b, res_s = path_summary(b_trajs, b_wall, b_extra), path_summary(s_trajs, s_wall, s_extra)
    ratio = res_b["tokens_per_s"] / res_s["tokens_per_s"] if res_s["tokens_per_s"] > 0 else float("inf")

    t = Table(title=f"Rollout throughput ({len(tasks)} tasks, same model/contract/tasks)")
    t.add_column("path")
    for col in ("trajectories", "gen tokens", "wall s", "gen tok/s", "mean turns", "task success", "tool calls"):
        t.add_column(col, justify="right")
    for name, r in (("batched (engine)", res_b), ("sequential (generate)", res_s)):
        t.add_row(
            name,
            str(r["trajectories"]),
            str(r["generated_tokens"]),
            f"{r['wall_s']:.2f}",
            f"{r['tokens_per_s']:.1f}",
            f"{r['mean_turns']:.2f}",
            f"{100 * r['task_success']:.1f}%",
            str(r["tool_calls"]),
        )
    con.print(t)
    con.print(f"[dim]batched: {b_extra}; sequential: {s_extra}[/dim]")
    print(f"batched/sequential generated tokens/s ratio: {ratio:.1f}x", flush=True)

    result = {
        "model": model_desc,
        "n_params": n_params,
        "tasks": len(tasks),
        "seed": args.seed,
        "threads": torch.get_num_threads(),
        "sampling": SAMPLING.model_dump(),
        "limits": LIMITS.model_dump(),
        "torch": torch.__version__,
        "batched": res_b,
        "sequential": res_s,
        "ratio": ratio,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

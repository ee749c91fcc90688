"""`mentorrl serve`: continuous batching vs the batch loop (``--no-continuous``) vs one request at a
time (``--max-batch 1``), in one run.

The same tiny model is served three times, one server after the other, each a real ``mentorrl serve``
subprocess on 127.0.0.1: first with ``--max-batch 1`` (the one-at-a-time baseline), then with the
batch loop (each batch decoded to its end), then with the default (continuous batching on the slot
decoder; the batch loop where the model has no slot decoder). Each gets the same chat requests from ``--clients`` threads at once,
as a black-box teacher's client keeps several requests in flight. The requests are agent
states: every prefix of a scripted expert's `orders` episode (system turn with the tools, the
user's task, tool calls and tool results) that ends before an assistant turn, rendered as
OpenAI messages with :func:`mentorrl.chat.trajectory_messages`; each asks for ``--n`` samples
at temperature 1 with a seed, as the acting teacher's scoring does.

Prints requests/s and generated tokens/s for each server and the ratios, and how many replies
the servers all agree on (seeded requests should not depend on what else was batched).

    python bench/serve_batching.py                     # ~40 s on 2 CPU cores
    python bench/serve_batching.py --requests 128 --clients 16 --model DIR --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from mentorrl.chat import trajectory_messages  # noqa: E402
from mentorrl.config import load_config  # noqa: E402
from mentorrl.contract import contract_for_env  # noqa: E402
from mentorrl.envs import get_env  # noqa: E402
from mentorrl.rollout.runner import expert_demonstrations  # noqa: E402
from mentorrl.serve import DEFAULT_BATCH_WINDOW_MS, DEFAULT_MAX_BATCH, serve_subprocess  # noqa: E402
from mentorrl.train.models_init import build_tiny_model  # noqa: E402

ENV_NAME = "orders"
_DEMO = load_config(Path(__file__).resolve().parent.parent / "mentorrl" / "configs" / "demo.yaml")


def prepare_model(args) -> Path:
    """``--model``, else the demo recipe's tiny model (random init), built once into ``--cache-dir``."""
    if args.model:
        return Path(args.model)
    return build_tiny_model(
        get_env(ENV_NAME), Path(args.cache_dir) / "serve-tiny", _DEMO.model.spec, corpus_tasks=200, seed=0
    )


def agent_states(model_dir: Path, count: int, seed: int) -> list[list[dict[str, Any]]]:
    """``count`` conversations that end before an assistant turn, from scripted expert episodes."""
    entry, tok = get_env(ENV_NAME), AutoTokenizer.from_pretrained(model_dir)
    env = entry.make_env()
    try:
        contract = contract_for_env(tok, env, _DEMO.sampling, _DEMO.limits, _DEMO.prompt)
    finally:
        env.close()
    tasks = entry.make_tasks().tasks("train", count, seed)
    states: list[list[dict[str, Any]]] = []
    for task, traj in zip(tasks, expert_demonstrations(contract, entry.make_env, entry.make_expert(), tasks)):
        messages = trajectory_messages(traj, tok, contract.system_text(), task.prompt)
        states += [messages[:i] for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(states) < count:
        raise SystemExit(f"only {len(states)} agent states from {count} tasks")
    return states[:count]


def serve_and_send(
    model_dir: Path, extra_args: list[str], bodies: list[dict[str, Any]], clients: int, threads: int
) -> tuple[float, list[dict[str, Any]]]:
    """(wall seconds, replies) for ``bodies`` sent from ``clients`` threads to a fresh server."""
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    with serve_subprocess(model_dir, extra_args=extra_args, env=env, timeout_s=300) as url:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        with httpx.Client(base_url=url, timeout=600, limits=limits) as http:

            def send(body: dict[str, Any]) -> dict[str, Any]:
                r = http.post("/chat/completions", json=body)
                r.raise_for_status()
                return r.json()

            with ThreadPoolExecutor(clients) as pool:
                list(pool.map(send, bodies[:clients]))  # warm-up
                t0 = time.perf_counter()
                replies = list(pool.map(send, bodies))
                return time.perf_counter() - t0, replies


def fingerprint(reply: dict[str, Any]) -> str:
    """A reply's choices without the random ids (tool-call ids, completion id)."""
    choices = [
        {
            **c["message"],
            "tool_calls": [t["function"] for t in c["message"].get("tool_calls") or []],
            "finish_reason": c["finish_reason"],
        }
        for c in reply["choices"]
    ]
    return json.dumps(choices, sort_keys=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint dir with a ChatML tokenizer (default: the tiny model)")
    p.add_argument("--cache-dir", default="runs/bench", help="where the tiny model is built once")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=8, help="client threads, each with one request in flight")
    p.add_argument("--n", type=int, default=4, help="samples per request")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server (0: torch's default)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    args = p.parse_args(argv)
    con = Console()

    model_dir = prepare_model(args)
    bodies = [
        {"messages": m, "n": args.n, "temperature": 1.0, "max_tokens": args.max_tokens, "seed": args.seed + i}
        for i, m in enumerate(agent_states(model_dir, args.requests, args.seed))
    ]
    arms = {"one at a time": ["--max-batch", "1"], "batch loop": ["--no-continuous"], "batched": []}
    results, fingerprints = {}, {}
    for name, extra in arms.items():
        con.print(f"[dim]{name}: serving {model_dir} {' '.join(extra)}[/dim]")
        wall, replies = serve_and_send(model_dir, extra, bodies, args.clients, args.threads)
        tokens = sum(r["usage"]["completion_tokens"] for r in replies)
        results[name] = {
            "wall_s": wall,
            "requests": len(replies),
            "completion_tokens": tokens,
            "requests_per_s": len(replies) / wall,
            "tokens_per_s": tokens / wall,
        }
        fingerprints[name] = [fingerprint(r) for r in replies]

    table = Table(
        title=f"mentorrl serve: {args.requests} requests (n={args.n}, max_tokens={args.max_tokens}) "
        f"from {args.clients} clients"
    )
    for col in ("server", "requests", "tokens", "wall s", "requests/s", "tokens/s"):
        table.add_column(col, justify="left" if col == "server" else "right")
    settings = {
        "one at a time": "--max-batch 1",
        "batch loop": f"--no-continuous --max-batch {DEFAULT_MAX_BATCH}",
        "batched": f"continuous, --max-batch {DEFAULT_MAX_BATCH} --batch-window-ms {DEFAULT_BATCH_WINDOW_MS:g}",
    }
    for name, r in results.items():
        table.add_row(
            f"{name} ({settings[name]})",
            str(r["requests"]),
            str(r["completion_tokens"]),
            f"{r['wall_s']:.1f}",
            f"{r['requests_per_s']:.2f}",
            f"{r['tokens_per_s']:.0f}",
        )
    con.print(table)
    ratio = results["batched"]["tokens_per_s"] / results["one at a time"]["tokens_per_s"]
    same = sum(len(set(f)) == 1 for f in zip(*fingerprints.values()))
    loop_ratio = results["batched"]["tokens_per_s"] / results["batch loop"]["tokens_per_s"]
    con.print(
        f"batched / one at a time: [bold]{ratio:.2f}x[/bold] tokens/s, "
        f"{results['batched']['requests_per_s'] / results['one at a time']['requests_per_s']:.2f}x requests/s"
    )
    con.print(f"continuous / batch loop: [bold]{loop_ratio:.2f}x[/bold] tokens/s")
    con.print(f"identical replies (seeded): {same}/{len(bodies)}")
    out = {
        "model": str(model_dir),
        "args": vars(args),
        "results": results,
        "ratio_tokens_per_s": ratio,
        "ratio_continuous_vs_batch_loop": loop_ratio,
        "identical_replies": same,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()

"""``mentorrl reward-audit ENV``: the reward-hacking audit and offline reward validation as a CI gate.

Exit status: 0 when every attack scores below the honest expert (and below 0 when it breaks a
hard constraint) and the validation AUC reaches ``--min-auc``; 1 when any check fails; 2 on
bad input (an unknown environment, no attacks registered for it, an unusable tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

DEFAULT_CACHE = Path("runs/.cache")
CORPUS_TASKS = 40  # expert transcripts the default tokenizer is trained on: enough for every tool and family


def tiny_tokenizer(env_name: str, cache_dir: Path, corpus_tasks: int = CORPUS_TASKS, seed: int = 0) -> Any:
    """The project's tiny BPE tokenizer for ``env_name``, built once into ``cache_dir`` and reused.

    Trained, as ``build_tiny_model`` does, on expert transcripts of train tasks (no model is
    built: the audit only needs to tokenise). The directory name hashes the inputs; a
    concurrent build is harmless (the second rename loses and its copy is dropped).
    """
    from transformers import AutoTokenizer

    from mentorrl.envs import get_env
    from mentorrl.models.build import ModelSpec, train_tokenizer
    from mentorrl.models.corpus import expert_transcripts

    entry = get_env(env_name)
    vocab_size = ModelSpec().vocab_size
    env = entry.make_env()
    try:
        key = hashlib.sha256(f"{env_name}:{env.version}|{corpus_tasks}|{vocab_size}|{seed}".encode()).hexdigest()[:12]
        path = Path(cache_dir) / f"tokenizer-{env_name}-{key}"
        if not (path / "tokenizer.json").exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tasks = entry.make_tasks().tasks(split="train", n=corpus_tasks, seed=seed)
            tok = train_tokenizer(expert_transcripts(env, entry.make_expert(), tasks), vocab_size)
            tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=path.parent))
            tok.save_pretrained(tmp)
            try:
                os.replace(tmp, path)
            except OSError:  # another process finished first
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        env.close()
    return AutoTokenizer.from_pretrained(path)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def audit_table(report: Any) -> Table:
    from mentorrl.integrity.attacks import iter_rows

    t = Table(
        title=f"Reward-hacking audit: {report.env_name}",
        caption="reward.total per attack; honest = lowest reward of the expert's successes on the same tasks",
    )
    for col in ("attack", "hard", "tasks", "max", "mean", "honest", "result"):
        t.add_column(col, justify="right" if col in ("tasks", "max", "mean", "honest") else "left", no_wrap=True)
    for row in iter_rows(report):
        style = "green" if row[6] == "PASS" else "red"
        t.add_row(*row[:6], f"[{style}]{row[6]}[/{style}]")
    return t


def failure_lines(report: Any) -> list[str]:
    """One line per failed attack with the reason (the table has no room for it at 80 columns)."""
    return [f"[red]FAIL[/red] {a.name}: {a.reason}" for a in report.attacks if not a.passed]


def validation_table(report: Any) -> Table:
    t = Table(title="Offline reward validation (correct = expert; others = corrupted expert)")
    for col in ("label", "n", "mean", "max"):
        t.add_column(col, justify="left" if col == "label" else "right")
    for label, s in report.by_label().items():
        t.add_row(label, str(s["n"]), _num(s["mean"]), _num(s["max"]))
    return t


def validation_summary(report: Any, min_auc: float, max_overlap: float = 0.0) -> str:
    if not report.n_correct or not report.n_incorrect:
        return f"[red]validation needs both classes: {report.n_correct} correct, {report.n_incorrect} incorrect[/red]"
    rng = report.range_overlap
    overlap = "none" if rng is None else f"[{rng[0]:.3f}, {rng[1]:.3f}]"
    verdict = "[green]PASS[/green]" if report.passed(min_auc, max_overlap) else "[red]FAIL[/red]"
    return (
        f"AUC {report.auc:.4f} (min {min_auc:g}) {verdict}; correct n={report.n_correct} "
        f"mean {sum(report.scores(True)) / report.n_correct:.3f}; incorrect n={report.n_incorrect} "
        f"mean {sum(report.scores(False)) / report.n_incorrect:.3f}; incorrect >= lowest correct: "
        f"{100 * report.overlap_share:.1f}%; range overlap {overlap}"
    )


def register(app: typer.Typer) -> None:
    """Add the ``reward-audit`` command to ``app``."""

    @app.command("reward-audit")
    def reward_audit(
        env: str = typer.Argument(..., help="registered environment, e.g. orders"),
        tasks: int = typer.Option(3, "--tasks", min=1, help="tasks per attack"),
        seed: int = typer.Option(0, "--seed", help="seed of the task pool"),
        split: str = typer.Option("train", "--split", help="task split (train, heldout, ...)"),
        tokenizer: Optional[Path] = typer.Option(
            None, "--tokenizer", help="Hugging Face tokenizer or checkpoint directory (default: the tiny tokenizer)"
        ),
        cache_dir: Path = typer.Option(DEFAULT_CACHE, "--cache-dir", help="where the tiny tokenizer is cached"),
        validate: bool = typer.Option(True, "--validate/--no-validate", help="also run the offline validation"),
        validate_tasks: int = typer.Option(40, "--validate-tasks", min=1, help="tasks in the validation set"),
        min_auc: float = typer.Option(0.99, "--min-auc", min=0.0, max=1.0, help="validation AUC required to pass"),
        max_overlap: float = typer.Option(
            0.0,
            "--max-overlap",
            min=0.0,
            max=1.0,
            help="largest share of incorrect trajectories allowed at or above the lowest correct one",
        ),
        json_path: Optional[Path] = typer.Option(None, "--json", help="write the full report as JSON"),
    ) -> None:
        """Run scripted reward-hacking attacks and the offline reward validation; exit 1 on any failure."""
        from mentorrl.cli_common import console, err
        from mentorrl.envs import get_env
        from mentorrl.integrity.attacks import AttackAuditConfig, audit_env, get_attacks
        from mentorrl.integrity.validation import get_corruptions, validate_env

        try:
            get_env(env)
            attacks = get_attacks(env)
            if validate:
                get_corruptions(env)
            config = AttackAuditConfig(tasks_per_attack=tasks, seed=seed, split=split)
        except ValueError as e:
            err.print(f"[red]{e}[/red]")
            raise typer.Exit(2) from None
        tok = _load_tokenizer(env, tokenizer, cache_dir, err)
        try:
            report = audit_env(env, tok, config, attacks=attacks)
        except ValueError as e:  # e.g. an unknown split
            err.print(f"[red]{e}[/red]")
            raise typer.Exit(2) from None
        console.print(audit_table(report))
        for line in failure_lines(report):
            console.print(line)
        honest_line = (
            f"honest expert: {len(report.honest_rewards)} tasks, lowest success reward {_num(report.honest_min)}"
        )
        if report.honest_failures:
            honest_line += f"; [red]failed on {', '.join(report.honest_failures)}[/red]"
        if report.honest_unfit:
            honest_line += f"; [yellow]cut short by the limits on {', '.join(report.honest_unfit)}[/yellow]"
        console.print(honest_line)
        passed = report.passed
        out: dict[str, Any] = {"audit": report.to_dict(), "validation": None}
        if validate:
            val = validate_env(env, tok, n_tasks=validate_tasks, seed=seed, split=split)
            console.print(validation_table(val))
            console.print(validation_summary(val, min_auc, max_overlap))
            out["validation"] = {
                **val.to_dict(),
                "min_auc": min_auc,
                "max_overlap": max_overlap,
                "passed": val.passed(min_auc, max_overlap),
            }
            passed = passed and val.passed(min_auc, max_overlap)
        out["passed"] = passed
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(out, indent=2))
        console.print("[green]reward audit passed[/green]" if passed else "[red]reward audit FAILED[/red]")
        if not passed:
            raise typer.Exit(1)


def _load_tokenizer(env: str, tokenizer: Optional[Path], cache_dir: Path, err: Console) -> Any:
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        if tokenizer is None:
            return tiny_tokenizer(env, cache_dir)
        if not tokenizer.is_dir():
            raise OSError(f"--tokenizer {tokenizer} is not a directory")
        return transformers.AutoTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError) as e:
        err.print(f"[red]cannot load a tokenizer: {e}[/red]")
        raise typer.Exit(2) from None


__all__ = ["register", "tiny_tokenizer", "audit_table", "failure_lines", "validation_table", "validation_summary"]

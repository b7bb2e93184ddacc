"""LoRA policies (``policy.lora``), through the real PolicyWorker (one gloo rank, in this process) and its
real colocated hf engine: only the adapters train, the reference is the base with them off, a refit
moves the adapters alone, and bad settings are one line naming the key."""

from __future__ import annotations

import pytest
import torch

from tests.policy.helpers import one_rank_worker, refit_samples
from trainer.config import ConfigError, load
from trainer.policy.batch import Sample


def _train(w, samples: list[Sample]) -> dict:
    tokens = float(sum(len(s.response_ids) for s in samples))
    return w.train([samples], [{"tokens": tokens, "seqs": float(len(samples))}])


@pytest.fixture
def worker(tiny_model_path):
    """A LoRA PolicyWorker (world of 1, gloo, rank 8, KL penalty on) with a colocated hf engine."""
    overrides = [
        "cluster.keep_freed_memory=false",
        "policy.lora.rank=8",
        "policy.learning_rate=0.05",
        "grpo.loss.reference_policy_kl_penalty=0.01",
    ]
    with one_rank_worker(tiny_model_path, overrides, colocated_engine=True) as w:
        yield w


def test_should_train_only_the_adapters_when_policy_lora_is_set(worker):
    names = {id(p): n for n, p in worker.model.named_parameters()}
    in_optimizer = [names[id(p)] for group in worker.optimizer.param_groups for p in group["params"]]
    assert in_optimizer and all(".lora_A." in n or ".lora_B." in n for n in in_optimizer)
    assert 0 < worker.info["trainable_params"] < worker.info["num_params"] / 5
    before = worker.full_state_dict()
    samples = refit_samples()
    for s, lp in zip(samples, worker.compute_logprobs(samples)):
        s.old_logprobs = lp
    for s, lp in zip(samples, worker.compute_logprobs(samples, reference=True)):
        s.ref_logprobs = lp
    _train(worker, samples)
    after = worker.full_state_dict()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".lora_" in n for n in changed)  # the base is frozen
    assert any(".lora_B." in n for n in changed)  # B starts at zero: the adapter now does something
    for n, p in worker.model.named_parameters():
        assert (p.grad is not None) == (".lora_" in n), n


def test_should_score_with_the_base_model_when_the_reference_has_its_adapters_off(worker, tiny_model_path):
    from trainer.models import load_model

    samples = refit_samples()
    for _ in range(2):  # adapters far from zero
        for s, lp in zip(samples, worker.compute_logprobs(samples)):
            s.old_logprobs = lp
        for s, lp in zip(samples, worker.compute_logprobs(samples, reference=True)):
            s.ref_logprobs = lp
        _train(worker, samples)
    assert worker.ref_model is None  # no second model
    policy = worker.compute_logprobs(samples)
    reference = worker.compute_logprobs(samples, reference=True)
    base = load_model(tiny_model_path, "float32")
    with torch.no_grad():
        for s, ref in zip(samples, reference):
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = base(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]
            want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.response_ids)[:, None])[
                :, 0
            ]
            assert torch.allclose(torch.tensor(ref), want, atol=1e-5)
    assert max(abs(a - b) for p, r in zip(policy, reference) for a, b in zip(p, r)) > 1e-3


def test_should_refit_the_adapters_alone_when_a_colocated_hf_engine_serves_a_lora_policy(worker):
    samples = refit_samples()
    for s, lp in zip(samples, worker.compute_logprobs(samples)):
        s.old_logprobs = lp
    for s, lp in zip(samples, worker.compute_logprobs(samples, reference=True)):
        s.ref_logprobs = lp
    _train(worker, samples)
    sent = dict(worker.iter_adapter_weights())
    assert sent and all(".lora_" in n for n in sent)
    worker.refresh_engine()
    engine = worker.engine_state_dict()
    policy = worker.full_state_dict()
    assert all(torch.equal(engine[n], policy[n]) for n in policy)  # adapters and (untouched) base alike
    meta = worker.weight_metadata()
    assert meta["names"] == list(sent)  # what a disaggregated refit announces: the adapters, in this order


def test_should_name_the_key_when_policy_lora_is_bad(tiny_model_path):
    from trainer.models import load_model
    from trainer.models.lora import apply

    with pytest.raises(ConfigError, match=r"^policy\.lora\.rank=0 must be >= 1"):
        load(["experiment=tiny", "policy.lora.rank=0"])
    with pytest.raises(ConfigError, match=r"^policy\.lora\.rank=600: generation\.backend=vllm"):
        load(["experiment=tiny", "policy.lora.rank=600", "generation.backend=vllm"])
    with pytest.raises(ConfigError, match=r"^generation\.vllm_kwargs\.enable_lora: set by kuberl"):
        load(
            [
                "experiment=tiny",
                "policy.lora.rank=8",
                "generation.backend=vllm",
                "+generation.vllm_kwargs.enable_lora=true",
            ]
        )
    lora = load(
        ["experiment=tiny", "policy.lora.rank=8", "policy.lora.target_modules=[q_proj,c_attn]"]
    ).policy.lora
    with pytest.raises(
        ConfigError, match=r"^policy\.lora\.target_modules: .* no linear layer named 'c_attn'"
    ):
        apply(load_model(tiny_model_path, "float32"), lora)


IDS = torch.tensor([[2, 5, 10, 20, 3, 7, 33, 41], [2, 11, 12, 13, 14, 15, 16, 17]])  # (B, T) token ids


def test_should_give_the_policys_logits_when_a_lora_checkpoint_converts_to_an_adapter_or_a_merged_model(
    worker, tiny_model_path, tmp_path
):
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint import FORMAT, write_marker
    from trainer.tools import eval as trainer_eval
    from trainer.tools.convert import convert

    samples = refit_samples()
    for _ in range(2):
        for s, lp in zip(samples, worker.compute_logprobs(samples)):
            s.old_logprobs = lp
        for s, lp in zip(samples, worker.compute_logprobs(samples, reference=True)):
            s.ref_logprobs = lp
        _train(worker, samples)
    step = tmp_path / "step_2"
    worker.save_checkpoint(str(step))
    (step / "training_info.json").write_text(json.dumps({"step": 2, "checkpoint_format": FORMAT}))
    write_marker(step, 2)  # as the driver commits it
    worker._reshard()
    with torch.no_grad():
        want = worker.model(input_ids=IDS).logits
        base_logits = AutoModelForCausalLM.from_pretrained(tiny_model_path)(input_ids=IDS).logits
    assert (want - base_logits).abs().max() > 1e-3  # the adapters matter

    convert(step, tmp_path / "adapter")
    convert(step, tmp_path / "merged", merge=True)
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_path), tmp_path / "adapter"
        )
        assert torch.allclose(peft_model(input_ids=IDS).logits, want, atol=1e-5)  # plain peft loads it
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        assert torch.allclose(merged(input_ids=IDS).logits, want, atol=1e-5)
    # trainer.tools.eval serves the adapter directory over its base (the one its config names)
    args = trainer_eval.parse_args([f"model={tmp_path / 'adapter'}", "data=arithmetic", "dtype=float32"])
    engine = trainer_eval.build_engine(args, trainer_eval.resolve_model_path(args.model))
    with torch.no_grad():
        assert torch.allclose(engine.model(input_ids=IDS).logits, want, atol=1e-5)


def _tiny_gemma3():
    """A tiny random Gemma 3 as the 27B is built: a language model and a SigLIP vision tower, both with
    attention layers named q_proj, k_proj and v_proj."""
    from transformers import AutoModelForCausalLM, Gemma3Config

    config = Gemma3Config(
        text_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "vocab_size": 300,
            "sliding_window": 16,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
    )
    return AutoModelForCausalLM.from_config(config)


def test_should_adapt_only_the_language_model_when_the_model_is_multimodal():
    from trainer.config import LoRAConfig
    from trainer.models.lora import apply, is_adapter

    model = _tiny_gemma3()
    assert any(n.startswith("model.vision_tower.") and n.endswith("q_proj") for n, _ in model.named_modules())
    apply(model, LoRAConfig(rank=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"]))
    adapted = sorted({n.split(".lora_")[0] for n, _ in model.named_parameters() if is_adapter(n)})
    assert adapted and all(n.startswith("model.language_model.layers.") for n in adapted), adapted
    assert len(adapted) == 2 * 5  # every target of both decoder layers


def test_should_name_the_language_models_layers_when_a_target_exists_only_in_the_vision_tower():
    from trainer.config import LoRAConfig
    from trainer.models.lora import check_targets

    with pytest.raises(
        ConfigError, match=r"policy.lora.target_modules: .* no linear layer named 'fc1'.*q_proj"
    ):
        check_targets(_tiny_gemma3(), LoRAConfig(rank=4, target_modules=["q_proj", "fc1"]))

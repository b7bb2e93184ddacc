"""trainer.perf: the FLOPs formula against a hand count, the GPU peak table, peak memory readings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trainer import perf

from .conftest import REPO

# SmolLM2-135M(-Instruct)'s config.json: hidden 576, intermediate 1536, 30 layers, 9 query heads and 3
# key/value heads of 64, vocabulary 49152, tied embeddings.
#
# Matmul parameters per layer, by hand:
#   q_proj 576 x 576 = 331,776      k_proj 576 x 192 = 110,592      v_proj 576 x 192 = 110,592
#   o_proj 576 x 576 = 331,776      gate, up, down 3 x 576 x 1536 = 2,654,208
#   sum 3,538,944; x 30 layers = 106,168,320
# LM head (the tied embedding, multiplied by every token's last hidden state): 576 x 49152 = 28,311,552
# N = 106,168,320 + 28,311,552 = 134,479,872 (the model's 134,515,008 parameters less 61 RMSNorm weight
# vectors of 576, which no matmul uses: 35,136)
SMOLLM2_N = 134_479_872
# One 64-token sample, forward and backward:
#   linear layers: 6 x N x 64 = 6 x 134,479,872 x 64 = 51,640,270,848
#   attention: 12 x 30 layers x 9 heads x 64 head_dim x (64 x 65 / 2 = 2080 causal pairs)
#            = 207,360 x 2080 = 431,308,800
#   total 52,071,579,648
SMOLLM2_64_TOKENS = 52_071_579_648


def smollm2() -> perf.ModelFlops:
    return perf.ModelFlops.of(
        hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152
    )


def test_should_match_the_hand_count_when_counting_smollm2_135m_training_flops() -> None:
    m = smollm2()
    assert m.matmul_params == SMOLLM2_N
    assert m.training([64]) == SMOLLM2_64_TOKENS
    # Samples add up; attention grows with each sample's own pairs, not the batch's.
    assert m.training([64, 64]) == 2 * SMOLLM2_64_TOKENS
    assert m.training([128]) > 2 * SMOLLM2_64_TOKENS
    # A frozen base (LoRA) computes no weight gradients: 4N per token, attention unchanged.
    assert m.training([64], frozen_base=True) == 4 * SMOLLM2_N * 64 + 431_308_800


def test_should_count_the_lm_head_only_on_the_positions_it_projects() -> None:
    """The policy projects only the positions that predict a response token (trainer.policy.batch): a
    sample of 48 prompt and 16 response tokens pays the head 16 times, not 64."""
    m = smollm2()
    head = 576 * 49152
    assert m.head_params == head
    assert m.training([64], projected=16) == SMOLLM2_64_TOKENS - 6 * head * 48
    assert m.training([64], projected=64) == m.training([64])
    assert (
        m.training([64], frozen_base=True, projected=16) == 4 * SMOLLM2_N * 64 + 431_308_800 - 4 * head * 48
    )


def test_should_count_the_matmul_parameters_of_every_linear_when_the_shape_comes_from_the_model(
    tiny_model_path,
) -> None:
    """The formula against the model itself (trainer.tools.plan builds it on the meta device): N is exactly
    the weights of its nn.Linear layers, the LM head included."""
    from trainer.models.shape import model_shape

    shape = model_shape(tiny_model_path)
    # shape.linears are the decoder's (LoRA's targets); the LM head is the one linear beside them
    linears = sum(i * o for pairs in shape.linears.values() for i, o in pairs) + shape.hidden * shape.vocab
    assert perf.ModelFlops.from_shape(shape).matmul_params == linears


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H200", 989.4),
        ("NVIDIA B200", 2250),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA L4", 121),
        ("NVIDIA L40S", 362.05),
    ],
)
def test_should_find_the_bf16_peak_when_the_gpu_is_in_the_table(name: str, tflops: float) -> None:
    assert perf.gpu_peak_flops(name) == pytest.approx(tflops * 1e12)


def test_should_have_no_table_peak_when_the_gpu_is_unknown() -> None:
    assert perf.gpu_peak_flops("NVIDIA GeForce GTX 1080") is None


def test_should_measure_a_cpu_peak_once_when_asked_twice() -> None:
    peak, source = perf.device_peak_flops(torch.device("cpu"), "float32")
    assert peak > 1e8 and "measured matmul" in source
    assert perf.device_peak_flops(torch.device("cpu"), None)[0] == peak  # cached: measured once


@pytest.mark.integration  # a Python interpreter of its own
def test_should_report_the_interval_peak_when_memory_is_freed_between_readings() -> None:
    """In a fresh process with glibc's default malloc, so that the freed block leaves the resident set (a
    test session's process may keep freed memory: trainer.cluster's keep_freed_memory settings)."""
    code = (
        "import torch\n"
        "from trainer import perf\n"
        "cpu = torch.device('cpu')\n"
        "perf.peak_memory_bytes(cpu)\n"  # start an interval
        "block = torch.ones(64 * 2**20, dtype=torch.uint8)\n"  # 64 MiB, touched
        "del block\n"
        "print(perf.peak_memory_bytes(cpu), perf.peak_memory_bytes(cpu))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = map(float, out.stdout.split())
    assert first > 0 and second > 0
    assert first - second > 32 * 2**20  # the second interval never held the block


def test_should_divide_by_time_and_peak_when_computing_mfu() -> None:
    assert perf.mfu(50.0, 2.0, 100.0) == pytest.approx(0.25)
    assert perf.mfu(50.0, 2.0, 0.0) == 0.0


# ----- a mixture of experts -------------------------------------------------------------------------

# A tiny Qwen3-MoE, counted by hand: hidden 64, 4 layers, 4 query heads and 2 key/value heads of 16,
# vocabulary 1000, untied; 8 experts of width 32 with 2 routed per token; decoder_sparse_step 2 makes
# layers 1 and 3 MoE layers and mlp_only_layers [3] keeps layer 3 dense, so layer 1 alone routes; the dense
# MLPs are 128 wide.
#   attention per layer: q 64 x 64 + k 64 x 32 + v 64 x 32 + o 64 x 64 = 12,288; x 4 layers = 49,152
#   dense MLP (layers 0, 2, 3): 3 x 64 x 128 = 24,576; x 3 = 73,728
#   MoE layer 1, per token: router 64 x 8 = 512 and 2 experts of 3 x 64 x 32 = 6,144 each: 12,800
#   LM head 64 x 1000 = 64,000
#   N = 49,152 + 73,728 + 12,800 + 64,000 = 199,680 (active); the 6 experts a token skips: 6 x 6,144 = 36,864
# Every parameter: the 236,544 matmul weights, the untied input embedding (64,000), two RMSNorms of 64 and the
# q/k norms of 16 per layer (160 x 4 = 640) and the final norm (64): 301,248.
TINY_MOE = dict(
    vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    decoder_sparse_step=2, mlp_only_layers=[3], tie_word_embeddings=False,
)  # fmt: skip


def _config_dir(tmp_path, config) -> str:
    """A model directory holding only ``config``'s config.json: all that model_shape reads."""
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def _real(config):
    """The model itself, on the CPU, with transformers' experts loop and eager attention (what torch's flop
    counter sees token by token)."""
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation="eager", attn_implementation="eager"
    )


def test_should_count_the_router_and_the_routed_experts_only_when_the_model_is_a_mixture_of_experts(
    tmp_path,
) -> None:
    import transformers

    from trainer.models.shape import model_shape

    config = transformers.Qwen3MoeConfig(**TINY_MOE)
    shape = model_shape(_config_dir(tmp_path, config))
    assert shape.moe is not None and (shape.moe.layers, shape.moe.experts, shape.moe.top_k) == (1, 8, 2)
    m = perf.ModelFlops.from_shape(shape)
    assert m.matmul_params == 199_680
    assert m.unrouted_params == 36_864 and m.total_matmul_params == 236_544
    assert m.head_params == 64_000
    # the total against the model itself: every parameter, every expert
    assert shape.params == 301_248 == sum(p.numel() for p in _real(config).parameters())
    # one token forward and backward: 6 N, and attention's one (query, key) pair per layer and head
    assert m.training([1]) == 6 * 199_680 + 12 * 4 * 4 * 16


def _moe_configs():
    import transformers

    common = dict(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    return {
        "qwen3_moe": transformers.Qwen3MoeConfig(**TINY_MOE),
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=128,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=1,
        ),  # fmt: skip
        "mixtral": transformers.MixtralConfig(
            **common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
        ),
        "olmoe": transformers.OlmoeConfig(
            **common, intermediate_size=32, num_experts=4, num_experts_per_tok=2
        ),
        "qwen3 (dense)": transformers.Qwen3Config(**common, intermediate_size=128, head_dim=16),
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3 (dense)"])
def test_should_match_the_flops_torch_counts_for_one_token_when_the_model_routes_it(family, tmp_path) -> None:
    """The formula against torch's own count of the model's forward (FlopCounterMode) for one token: it goes
    through its router, its top-k experts and a shared expert (Qwen2-MoE), never the other experts. One token
    has one (query, key) pair, so attention's share is exact too; the forward is a third of ``training``."""
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.models.shape import model_shape

    config = _moe_configs()[family]
    m = perf.ModelFlops.from_shape(model_shape(_config_dir(tmp_path, config)))
    model = _real(config)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.tensor([[5]]))
    assert counter.get_total_flops() * 3 == m.training([1])
    # every matmul weight the model holds: its matrices but the input embedding, which is a lookup
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n)
    assert m.total_matmul_params == matrices
    assert (m.unrouted_params > 0) == (family != "qwen3 (dense)")


def test_should_refuse_mfu_in_one_line_when_the_mixture_of_experts_family_is_not_read(tmp_path) -> None:
    """Granite-MoE routes too, but its routing is not read here: no MFU rather than one that counts every
    expert."""
    import transformers

    from trainer.models.shape import model_shape

    config = transformers.GraniteMoeConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    shape = model_shape(_config_dir(tmp_path, config))
    assert shape.moe is None and shape.params > 0  # the plan's memory still counts every parameter
    with pytest.raises(ValueError) as e:
        perf.ModelFlops.from_shape(shape)
    assert str(e.value) == (
        "model_type granitemoe is a mixture of experts whose routing kuberl does not read (read: mixtral, olmoe, "
        "qwen2_moe, qwen3_moe): its active parameters are not counted"
    )


def test_should_refuse_the_routing_it_read_when_the_model_holds_other_experts(tmp_path) -> None:
    """The config's reading is checked against the instantiated model's expert parameters: a reading off by
    one expert is a shape without active parameters (no MFU), not a wrong count."""
    import dataclasses

    import transformers

    from trainer.models import shape as shapes

    config = transformers.Qwen3MoeConfig(**TINY_MOE)
    moe = shapes.moe_of(config)
    assert moe is not None
    shapes._check_moe(moe, _real(config), 64)  # the right reading passes
    with pytest.raises(
        shapes.ShapeError, match="the model holds 49152 expert parameters where its config reads 43008"
    ):
        shapes._check_moe(dataclasses.replace(moe, experts=7), _real(config), 64)

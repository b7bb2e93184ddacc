"""A refit carries what the optimizer can change, never a frozen parameter, on both refit paths, with the
real PolicyWorker (one gloo rank, in this process).

The model has a frozen module, as gemma3-27b's vision tower is frozen for a text-only run: a whole decoder
block (an FSDP unit of its own, which the refit must not even gather) and the final norm (in the root unit,
beside trainable weights). It is frozen either by ``policy.freeze`` or by the model arriving with
``requires_grad`` off (what LoRA does to a base); either way the refit leaves it out:

- colocated: the rank's hf engine is handed the trainable tensors alone and ends up equal to the policy,
  the frozen weights being the ones it was built with;
- disaggregated: a vLLM engine in another process receives over the ``kuberl_gloo`` transport, counting the
  names and bytes that arrive, then samples; the policy scores those samples as the engine did.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.policy.helpers import one_rank_worker, refit_samples
from trainer.config import ConfigError, load
from trainer.policy.batch import Sample
from trainer.ports import free_port

FROZEN = ["model.layers.0.*", "model.norm.weight"]


def _frozen(name: str) -> bool:
    return name.startswith("model.layers.0.") or name == "model.norm.weight"


def _train(w) -> None:
    samples = refit_samples()
    tokens = float(sum(len(s.response_ids) for s in samples))
    w.train([samples], [{"tokens": tokens, "seqs": float(len(samples))}])


@pytest.fixture
def worker(request, tiny_model_path, monkeypatch):
    """A real PolicyWorker (world of 1, gloo) over the tiny model with FROZEN frozen; indirect parameter:
    how it is frozen ("config": ``policy.freeze``; "model": the model arrives with them frozen) and
    whether the rank has a colocated (hf) engine."""
    from trainer.policy import worker as worker_module

    how, colocated = request.param
    overrides = [
        "cluster.keep_freed_memory=false",
        "generation.backend=hf",
        "policy.learning_rate=0.05",
    ]
    if how == "config":
        overrides.append(f"policy.freeze=[{','.join(FROZEN)}]")
    else:
        build = worker_module.build_empty_model

        def frozen_model(*args, **kwargs):
            model = build(*args, **kwargs)
            for name, p in model.named_parameters():
                p.requires_grad_(not _frozen(name))
            return model

        monkeypatch.setattr(worker_module, "build_empty_model", frozen_model)
    with one_rank_worker(tiny_model_path, overrides, colocated_engine=colocated) as w:
        try:
            yield w
        finally:
            w.close_weight_sync()


def _base(tiny_model_path) -> dict[str, torch.Tensor]:
    from trainer.models import load_model

    return {n: p.detach() for n, p in load_model(tiny_model_path, "float32").named_parameters()}


@pytest.mark.parametrize(
    "worker", [("config", True), ("model", True)], ids=["policy.freeze", "requires_grad"], indirect=True
)
def test_should_load_only_trainable_weights_and_leave_the_frozen_ones_as_built_when_a_colocated_engine_refits(
    worker, tiny_model_path, monkeypatch
):
    from torch.distributed.fsdp import FSDPModule

    base = _base(tiny_model_path)
    _train(worker)
    policy = worker.full_state_dict()
    assert any(_frozen(n) for n in policy)
    for name, tensor in policy.items():  # trained, except what is frozen
        assert torch.equal(tensor, base[name]) == _frozen(name), name

    gathered: list[str] = []  # FSDP units unsharded by the refit, by their blocks' names
    names = {id(m): n for n, m in worker.model.named_modules()}
    unshard = FSDPModule.unshard

    def recording_unshard(self, *args, **kwargs):
        gathered.append(names[id(self)])
        return unshard(self, *args, **kwargs)

    monkeypatch.setattr(FSDPModule, "unshard", recording_unshard)
    loaded: list[tuple[str, int]] = []
    update = worker.engine.update_weights

    def counting(named_tensors):
        def each():
            for name, t in named_tensors:
                loaded.append((name, t.numel() * t.element_size()))
                yield name, t

        update(each())

    monkeypatch.setattr(worker.engine, "update_weights", counting)
    worker.refresh_engine()

    assert loaded and not [n for n, _ in loaded if _frozen(n)], "frozen weights were sent"
    assert sorted(n for n, _ in loaded) == sorted(n for n in policy if not _frozen(n))
    assert "model.layers.0" not in gathered and "model.layers.1" in gathered  # a frozen unit is not gathered
    assert sum(b for _, b in loaded) == worker.info["refit_bytes"]
    engine = worker.engine_state_dict()
    for (
        name,
        tensor,
    ) in policy.items():  # the engine is the policy: trained weights sent, frozen ones as built
        assert torch.equal(engine[name].to(tensor.dtype), tensor), name
    # What a disaggregated refit announces: the same names, in the gather's order.
    assert worker.weight_metadata()["names"] == [n for n, _ in loaded]


RECEIVER = """
    import json, sys
    from trainer.config import GenerationConfig
    from trainer.generation.base import SamplingParams
    from trainer.generation.refit import vllm_nccl
    from trainer.generation.vllm_engine import VLLMGenerationEngine

    path, out, info, update_info, temperature = sys.argv[1:6]
    received = {"names": [], "bytes": 0}
    receive_packed = vllm_nccl.receive_packed

    def counting(group, meta, buffer_bytes):  # what arrives, chunk by chunk
        for chunk in receive_packed(group, meta, buffer_bytes):
            received["names"] += [name for name, _ in chunk]
            received["bytes"] += sum(t.numel() * t.element_size() for _, t in chunk)
            yield chunk

    vllm_nccl.receive_packed = counting
    engine = VLLMGenerationEngine(path, GenerationConfig(), "float32", seed=0, max_model_len=256, threads=1,
                                  weight_transfer=True)
    try:
        engine.init_weight_receiver(json.loads(info))
        engine.receive_weights(json.loads(update_info))
        engine.close_weight_receiver()
        prompts = [[2, 8, 9, 10], [3, 11, 12]]
        params = SamplingParams(max_new_tokens=8, temperature=float(temperature), seed=3)
        received["samples"] = [[p, c.token_ids, c.logprobs] for p, cs in zip(prompts, engine.generate(prompts, 2, params)) for c in cs]
        with open(out, "w") as f:
            json.dump(received, f)
    finally:
        engine.shutdown()
"""


@pytest.mark.vllm
@pytest.mark.parametrize("worker", [("model", False)], ids=["requires_grad"], indirect=True)
def test_should_send_only_trainable_weights_and_sample_as_the_policy_scores_when_a_vllm_engine_receives_over_gloo(
    worker, tiny_model_path, tmp_path
):
    from trainer.generation.refit.transport import init_info

    _train(worker)
    update_info = worker.weight_metadata()
    assert update_info["names"] and not [n for n in update_info["names"] if _frozen(n)]
    port, out = free_port("127.0.0.1"), tmp_path / "received.json"
    info = init_info("127.0.0.1", port, rank_offset=1, world_size=2, buffer_bytes=16 * 1024)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(RECEIVER),
            tiny_model_path,
            str(out),
            json.dumps(info),
            json.dumps(update_info),
            str(worker.cfg.generation.temperature),
        ]
    )
    try:
        worker.init_weight_sync(init_info("127.0.0.1", port, 0, 2, 16 * 1024))
        stats = worker.broadcast_weights(update_info)
        worker.close_weight_sync()
        assert proc.wait(timeout=600) == 0, "the receiver failed (its output is above)"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    received = json.loads(out.read_text())
    assert received["names"] == update_info["names"]  # the trainable weights, and nothing frozen
    assert received["bytes"] == stats["bytes"] == worker.info["refit_bytes"]
    frozen_bytes = sum(t.numel() * 4 for n, t in _base(tiny_model_path).items() if _frozen(n))
    assert received["bytes"] + frozen_bytes == sum(t.numel() * 4 for t in _base(tiny_model_path).values())
    # The engine holds the trained weights and the frozen ones it was built with: the policy scores its
    # samples as the engine did (float32 on both sides; vLLM's fused kernels add only rounding).
    samples = [Sample(p, ids) for p, ids, _ in received["samples"]]
    gap = max(
        abs(a - b)
        for s, (_, _, lp) in zip(worker.compute_logprobs(samples), received["samples"])
        for a, b in zip(s, lp)
    )
    assert gap < 1e-3


def test_should_name_the_pattern_when_policy_freeze_matches_no_parameter(tiny_model_path):
    from trainer.policy.group import check_freeze

    cfg = load(["experiment=tiny", f"model.name={tiny_model_path}", "policy.freeze=[model.vision_tower.*]"])
    with pytest.raises(
        ConfigError, match=r"^policy\.freeze: 'model\.vision_tower\.\*' matches no parameter of "
    ):
        check_freeze(cfg, tiny_model_path)
    check_freeze(load(["experiment=tiny", f"policy.freeze=[{','.join(FROZEN)}]"]), tiny_model_path)


def test_should_freeze_the_vision_tower_and_projector_alone_when_gemma3_27b_trains_on_text():
    """gemma3-27b-gsm8k's ``policy.freeze`` against the real model's names (on the meta device, from the
    config trainer.models.shape knows offline): the vision tower and projector, nothing of the language model."""
    from fnmatch import fnmatchcase

    from transformers import AutoModelForCausalLM

    from trainer.models.shape import _hf_config

    cfg = load(["experiment=gemma3-27b-gsm8k"])
    config, _ = _hf_config(cfg.model.name, False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    frozen = {
        n: p.numel() for n, p in model.named_parameters() if any(fnmatchcase(n, f) for f in cfg.policy.freeze)
    }
    assert all(n.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for n in frozen)
    assert {n for n, _ in model.named_parameters() if not n.startswith("model.language_model.")} == set(
        frozen
    )
    assert 0.4e9 < sum(frozen.values()) < 0.45e9  # the 0.42B parameters no text-only step changes

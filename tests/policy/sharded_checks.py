"""What a policy rank built on the meta device must equal (:mod:`trainer.policy.sharded_init`): the whole
model loaded, moved and then sharded, in the same process group. Shared by the CPU ranks of
``tests/policy/test_sharded_init.py`` and the GPU rank of ``tests/gpu/test_sharded_init_cuda.py``."""

from __future__ import annotations

import torch

from tests.policy.helpers import skewed_samples


def _whole_then_sharded(w, attn: str | None = None) -> torch.nn.Module:
    """How a rank built its model before: loaded whole (adapters drawn right after the seed), then sharded."""
    from trainer.models import load_model
    from trainer.policy import packed_attention
    from trainer.policy.worker import shard_model

    cfg = w.cfg
    model = load_model(w.model_path, cfg.model.dtype, False, attn)
    if attn is None and w.lora is not None:
        from trainer.models import lora

        lora.apply(model, w.lora)
    if attn is None and cfg.model.attn_implementation:
        model.set_attn_implementation(cfg.model.attn_implementation)
    if w.attention is not None:
        packed_attention.install(model, cfg.model.attn_implementation or "sdpa", w.sp)
    model.config.use_cache = False
    model.to(w.device)
    shard_model(model, cfg.policy.reshard_after_forward if attn is None else True, None)
    return model


def compare(w) -> dict:
    """``w`` (a set-up PolicyWorker) against the whole-model path, in the same process group: what
    differs, as booleans and lists (empty: nothing). Collective (every rank calls it)."""
    rng_after_setup = torch.get_rng_state()
    torch.manual_seed(
        w.cfg.seed
    )  # as set-up seeded: then the policy's load, its adapters, the reference's load
    old = _whole_then_sharded(w)
    old_ref = (
        _whole_then_sharded(w, w.cfg.model.attn_implementation or "sdpa") if w.ref_model is not None else None
    )
    rng_old = torch.get_rng_state()
    mismatched = [
        n
        for (n, p), (_, q) in zip(w.model.named_parameters(), old.named_parameters())
        if p.to_local().dtype != q.to_local().dtype or not torch.equal(p.to_local(), q.to_local())
    ]
    names = [n for n, _ in w.model.named_parameters()] == [n for n, _ in old.named_parameters()]
    buffers = {n: torch.equal(b, dict(old.named_buffers())[n]) for n, b in w.model.named_buffers()}
    if w.ref_model is not None:
        mismatched += [
            f"ref:{n}"
            for (n, p), (_, q) in zip(w.ref_model.named_parameters(), old_ref.named_parameters())
            if not torch.equal(p.to_local(), q.to_local())
        ]
    samples = skewed_samples()
    new_lp, new_ref = w.compute_logprobs(samples), w.compute_logprobs(samples, reference=True)
    w.model, w.ref_model = old, (old_ref if old_ref is not None else w.ref_model)
    old_lp, old_ref_lp = w.compute_logprobs(samples), w.compute_logprobs(samples, reference=True)
    return {
        "names": names,
        "mismatched": mismatched,
        "buffers": buffers,
        "rng": torch.equal(rng_after_setup, rng_old),
        "logprobs": new_lp == old_lp,
        "ref_logprobs": new_ref == old_ref_lp,
        "adapters": sum(1 for n, _ in w.model.named_parameters() if ".lora_" in n),
    }


def check(result: dict, what: str, lora: bool) -> None:
    assert result["names"], f"{what}: another module tree"
    assert result["mismatched"] == [], f"{what}: shards differ"
    assert result["buffers"] and all(result["buffers"].values()), (
        f"{what}: buffers differ: {result['buffers']}"
    )
    assert result["logprobs"] and result["ref_logprobs"], f"{what}: logprobs differ"
    assert result["rng"], f"{what}: the random state after set-up differs"
    assert (result["adapters"] > 0) == lora

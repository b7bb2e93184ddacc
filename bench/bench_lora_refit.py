"""LoRA against full weights on this machine's CPU: what a refit costs, and what serving the adapter costs.

On the embedded SmolLM2-135M-Instruct with a rank-``--rank`` adapter on every linear layer of its blocks
(``policy.lora`` defaults; B filled with small random values, as after training), float32:

- refit, colocated hf engine: ``update_weights`` with the full state dict (a full-weight policy's refit)
  against ``update_adapter`` with the adapter tensors (a LoRA policy's, the adapter applied, not merged),
  and against merging (``W + alpha/r B @ A`` for every adapted weight, then loading those weights: what a
  merging engine would pay per refit);
- decode, hf engine: tokens/s with the adapter applied against the merged (plain) model: the price of not
  merging;
- refit, disaggregated: the bucketed gloo transport (:mod:`trainer.generation.refit.transport`) to a
  receiver process, full state against the adapter;
- refit, colocated vLLM (a process of its own, ``enable_lora``): ``update_weights`` with the full state
  against ``update_adapter`` (a PEFT directory on /dev/shm, loaded in place with ``add_lora``).

Both sides of each comparison run in one invocation, one after the other; the ratios are what to read
(the machine may be shared). The policy's own side (FSDP gathers) is not timed here.

    .venv/bin/python bench/bench_lora_refit.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_generation import bench_inputs, refit_disaggregated, throughput, timed  # noqa: E402


def lora_state(model, rank: int):
    """(policy state with adapters, adapter tensors alone, the LoRA config): ``model`` is adapted in place."""
    import torch

    from trainer.config import LoRAConfig
    from trainer.models import lora

    cfg = LoRAConfig(rank=rank)
    torch.manual_seed(0)
    lora.apply(model, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 1e-3)  # trained adapters are not zero
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    adapter = {n: t for n, t in state.items() if lora.is_adapter(n)}
    return state, adapter, cfg


def note(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


def mib(state: dict) -> float:
    return round(sum(t.numel() * t.element_size() for t in state.values()) / 2**20, 2)


def vllm_child(args) -> int:
    import torch

    from trainer.config import GenerationConfig
    from trainer.generation.factory import EngineSpec, build_engine

    torch.set_num_threads(args.threads)
    path, prompts, model, full = bench_inputs("float32")
    _, adapter, cfg = lora_state(model, args.rank)
    spec = EngineSpec(path, "float32", seed=0, max_model_len=1024, threads=args.threads, lora=cfg)
    engine = build_engine(GenerationConfig(backend="vllm"), spec)
    try:
        engine.update_weights(iter(full.items()))
        engine.update_adapter(iter(adapter.items()))  # untimed first calls: page faults, first load
        full_s, _ = timed(lambda: engine.update_weights(iter(full.items())), args.repeats)
        adapter_s, _ = timed(lambda: engine.update_adapter(iter(adapter.items())), args.repeats)
        tput = throughput(engine, prompts, 4, args.max_new_tokens, args.repeats)
    finally:
        engine.shutdown()
    print(
        "child-json:",
        json.dumps(
            {
                "full_s": round(full_s, 4),
                "adapter_s": round(adapter_s, 4),
                "tokens_per_s_with_adapter": tput["tokens_per_s"],
            }
        ),
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.vllm_child:
        return vllm_child(args)
    import copy

    import torch

    from trainer.generation.hf import HFGenerationEngine
    from trainer.models import load_tokenizer, lora

    torch.set_num_threads(args.threads)
    path, prompts, model, full = bench_inputs("float32")
    tok = load_tokenizer(path)
    plain = HFGenerationEngine(copy.deepcopy(model), tok, 64)
    state, adapter, cfg = lora_state(model, args.rank)
    adapted = HFGenerationEngine(model, tok, 64)
    out: dict = {"full_mib": mib(full), "adapter_mib": mib(adapter), "rank": args.rank}

    note("hf refit")
    plain.update_weights(iter(full.items()))
    adapted.update_adapter(iter(adapter.items()))
    full_s, _ = timed(lambda: plain.update_weights(iter(full.items())), args.repeats)
    adapter_s, _ = timed(lambda: adapted.update_adapter(iter(adapter.items())), args.repeats)

    def merge_refit():
        merged = lora.merged_state_dict(state, cfg)
        targets = {n: t for n, t in merged.items() if n.rsplit(".", 2)[-2] in cfg.target_modules}
        plain.update_weights(iter(targets.items()))

    merge_s, _ = timed(merge_refit, args.repeats)
    out["hf_refit"] = {
        "full_s": round(full_s, 4),
        "adapter_s": round(adapter_s, 4),
        "merge_s": round(merge_s, 4),
        "adapter_over_full": round(adapter_s / full_s, 3),
        "merge_over_full": round(merge_s / full_s, 3),
    }
    note("hf decode")
    merged_tput = throughput(plain, prompts, 4, args.max_new_tokens, args.repeats)
    adapted_tput = throughput(adapted, prompts, 4, args.max_new_tokens, args.repeats)
    out["hf_decode"] = {
        "merged_tokens_per_s": merged_tput["tokens_per_s"],
        "adapter_tokens_per_s": adapted_tput["tokens_per_s"],
        "adapter_over_merged": round(adapted_tput["tokens_per_s"] / merged_tput["tokens_per_s"], 3),
    }
    note("disaggregated transfer")
    t_full = refit_disaggregated(full, 256, args.repeats)
    t_adapter = refit_disaggregated(adapter, 256, args.repeats)
    out["disaggregated"] = {
        "full_s": t_full["seconds"],
        "adapter_s": t_adapter["seconds"],
        "adapter_over_full": round(t_adapter["seconds"] / t_full["seconds"], 3),
    }
    if not args.skip_vllm:
        note("vllm (a process of its own)")
        argv2 = [
            "--rank",
            str(args.rank),
            "--repeats",
            str(args.repeats),
            "--threads",
            str(args.threads),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--vllm-child",
        ]
        proc = subprocess.run([sys.executable, __file__, *argv2], capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("child-json: ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"bench: the vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        v = json.loads(lines[-1].removeprefix("child-json: "))
        v["adapter_over_full"] = round(v["adapter_s"] / v["full_s"], 3)
        out["vllm_colocated"] = v
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The generation interface every backend implements (``hf`` and ``vllm``).

An engine turns prompt token ids into sampled continuations with per-token logprobs, and accepts new
weights after each optimizer step. It is built by :func:`trainer.generation.factory.build_engine`.
Colocated or disaggregated placement (:mod:`trainer.generation.placement`) is decided by who owns
the engine (a policy rank, or a generation actor), not by the engine itself.

Lifecycle: an engine that shares its device with training (colocated) is put to ``sleep`` after it
generated, before the policy's own forwards (logprob passes, training), and woken in two parts at the
refit: its weights, then (after the new ones are loaded) its KV cache, so the gathered weights and a full
KV cache never share the device. An engine asked to generate while asleep wakes itself first, unless its
weights were discarded (vLLM's level-2 sleep, for full-weight refits): it then refuses until a refit has
loaded them. Engines that cannot free anything (the hf engine, vLLM on CPU) free nothing, but take the
same calls and give the same answers.
``shutdown`` releases everything the engine started (for vLLM, its engine-core process) and may be
called more than once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_strings: list[str] = field(default_factory=list)
    # One seed for the whole call: each backend draws its samples from it in its own way (its module says how).
    seed: int | None = None
    # One seed per prompt of the call instead (not both): sample j of prompt i draws from seeds[i] + j alone,
    # whatever else the call holds, so a prompt's draws do not depend on the prompts batched beside it.
    seeds: list[int] | None = None
    # Return each sample's routes when the model is a mixture of experts (Completion.routes); a dense model's
    # engine returns none.
    routes: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_prompts(self, idx: list[int]) -> SamplingParams:
        """These parameters for the prompts ``idx`` of the call, as a call of their own (a worker's share)."""
        return self if self.seeds is None else replace(self, seeds=[self.seeds[i] for i in idx])

    def prompt_seeds(self, prompts: int) -> list[int | None]:
        """The seed of each of a call's ``prompts`` prompts (``seed`` for every one when not seeded per
        prompt); ValueError when ``seeds`` does not match the call."""
        if self.seeds is None:
            return [self.seed] * prompts
        if self.seed is not None:
            raise ValueError(f"seed={self.seed} and seeds are both set: give one seed per call or per prompt")
        if len(self.seeds) != prompts:
            raise ValueError(f"{len(self.seeds)} seeds for {prompts} prompts: give one seed per prompt")
        return list(self.seeds)


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    token_ids: list[int]  # (L,) generated tokens, EOS included when the model stopped
    logprobs: list[float]  # (L,) logprob of each generated token under the sampling model
    text: str  # decoded without special tokens (what rewards read)
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    # Decoded with special tokens kept, the turn-ending token left out: what a tool parser reads, as some
    # families' call markers are special tokens (trainer.generation.tool_parsers.parser_text). None: not decoded.
    raw_text: str | None = None
    # An MoE model's routes when asked (SamplingParams.routes): a (prompt + L - 1, layers, k) array of the expert
    # ids each layer routed each computed position to (the last sampled token is never fed back), uint8 (uint16
    # past 256 experts); vLLM's ``routed_experts`` and the hf engine's alike. None: not asked, or a dense model.
    routes: Any = None


class GenerationEngine(Protocol):
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """For each prompt (token ids), ``n`` completions: result[i][j] is sample j of prompt i. With
        ``params.seeds`` each prompt's samples draw from their own seeds (:class:`SamplingParams`); ValueError
        when they do not match the prompts."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights: full, unsharded tensors under their Hugging Face names, in
        whatever layout the sender has; the engine maps them onto its own (vLLM fuses q/k/v)."""
        ...

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """LoRA (an engine built with ``EngineSpec.lora``): load the policy's new adapters, every adapter
        tensor under the policy's name (``...q_proj.lora_A.default.weight``); the base stays as it is."""
        ...

    @property
    def reloads_every_weight(self) -> bool:
        """True when sleep discards the weights (vLLM's level 2), so the refit after it must bring every
        weight, frozen ones too, not only those the optimizer changed."""
        ...

    def sleep(self) -> None:
        """Free what generation holds (KV cache, weights) while the policy trains; idempotent; frees
        nothing where unsupported."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep`: ``tags`` of "weights" and "kv_cache" (vLLM's names), None for both."""
        ...

    def shutdown(self) -> None:
        """Release the engine and every process it started; idempotent."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """An engine that takes weights from another process through a receiver of its own (vLLM's
    weight-transfer API); engines without one are fed a stream in :meth:`GenerationEngine.update_weights`."""

    def init_weight_receiver(self, init_info: dict) -> None:
        """Join the group rooted at the sender (rank 0). ``init_info`` is vLLM's NCCL init info
        (:func:`~trainer.generation.refit.transport.init_info`): this engine's workers take the ranks
        from ``rank_offset`` on."""
        ...

    def receive_weights(self, update_info: dict) -> None:
        """Receive one full set of weights, as ``update_info`` (names, dtype_names, shapes) announces."""
        ...

    def receive_adapter(self, update_info: dict) -> None:
        """LoRA (an engine built with ``EngineSpec.lora``): receive the policy's adapters alone, over the same
        group, as ``update_info`` announces them."""
        ...

    def close_weight_receiver(self) -> None:
        """Leave the group, in step with the sender (:meth:`~trainer.generation.refit.group.WeightSyncGroup.close`);
        the engine goes on generating. Idempotent."""
        ...

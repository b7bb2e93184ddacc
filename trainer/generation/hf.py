"""Hugging Face generation backend: our own batched decode loop over a transformers model and its KV cache.

It runs anywhere transformers runs (CPU included), which makes it the backend of the CPU demo and of
the tests; on GPUs the vLLM backend implements the same :class:`GenerationEngine` interface.

The loop replaces ``model.generate`` because most of a GRPO step on CPU is spent here; each choice
below was measured against the plain alternative (the figures: bench/README.md, "Why the code is as it
is").

- Prefix sharing: the n samples of a prompt share its prompt, so each distinct prompt of a batch is
  prefilled once and its KV-cache rows are then copied to its samples.
- Sampling draws one uniform number per row (``_draw``) where torch.multinomial on CPU draws one per
  vocabulary entry.
- A static KV cache: keys/values live in preallocated (B, heads, len, dim) tensors written in place,
  where a DynamicCache re-allocates the whole cache with torch.cat every step (equal for short
  completions, faster for long ones). Models whose cache layers are of other kinds fall back to a
  DynamicCache.
- bf16 weights on CPU: linear layers prepacked for oneDNN (:mod:`trainer.generation.onednn_linear`),
  repacked after each weight update; only on CPUs whose instruction set oneDNN's bf16 reorder supports
  (not AVX2-only ones: the plain forward stays there).
- Seeds: one seed for a call (``params.seed``) draws every row from one generator, as torch.manual_seed
  would; seeds per prompt (``params.seeds``) give each row (sample j of prompt i: seeds[i] + j) a stream of
  its own, drawn up front, one number per step, so its tokens do not depend on the rows beside it.
- Logprobs are gathered the step a token is sampled, from the (B, V) log-softmax of that step only,
  instead of asking for all logits, which would hold a (B, L, V) tensor (1.6 GB for 64 x 128 tokens of
  a 49k vocab).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from trainer.generation import onednn_linear
from trainer.generation.base import Completion, SamplingParams
from trainer.generation.tool_parsers import parser_text
from trainer.models import moe
from trainer.models.prompts import distinct_prompts

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Attention implementations known to work with a StaticCache and a padded 2D attention mask.
_STATIC_CACHE_ATTN = ("sdpa", "eager")
# Columns a static cache grows by. Attention runs over every allocated column, so a cache sized for
# max_new_tokens from the start makes short completions pay for long ones; each growth is one copy of the
# cache (bench/README.md, "Why the code is as it is").
_CACHE_CHUNK = 32
_DRAW_BLOCK = 256  # tokens per block of the two-level CDF inversion in _draw


def _sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens (B,) and their logprobs (B,) from float32 ``logits`` (B, V); the draws from ``generator``
    (None: torch's default one), or ``uniform`` (B, 1) when given: each row's number in [0, 1).

    Sampling applies temperature, then top-k, then top-p, as HF's warpers do. The logprob is that of the
    temperature-scaled distribution before top-k/top-p truncation, like vLLM's default: a truncated
    distribution would give -inf to tokens the trainer's own forward pass still sees as possible.
    """
    temperature = params.temperature if params.temperature > 0 else 1.0
    scores = logits / temperature  # (B, V)
    logprobs = torch.log_softmax(scores, dim=-1)  # (B, V)
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    elif params.top_k > 0 or params.top_p < 1.0:
        if params.top_k > 0:
            kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_scores, sorted_idx = torch.sort(scores, descending=False)  # (B, V) ascending
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= (1 - params.top_p)  # the low tail holding at most 1 - top_p of the mass
            remove[:, -1:] = False  # always keep the most likely token
            scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
        tokens = _draw(torch.softmax(scores, dim=-1), generator, uniform)
    else:
        tokens = _draw(logprobs.exp(), generator, uniform)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _draw(
    probs: torch.Tensor, generator: torch.Generator | None = None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row of ``probs`` (B, V), by inverting its CDF with one uniform number per row (drawn
    from ``generator``; None: torch's default one; or ``uniform`` (B, 1), already drawn, of
    :func:`_draw_dtype`).

    Distributed as ``torch.multinomial(probs, 1)``, which on CPU draws an exponential per vocabulary
    entry: 8 ms for 8 x 49k (a tenth of a SmolLM2-135M decode step). A running sum over the whole
    vocabulary is sequential and still costs 1.6 ms there, so the inversion goes in two levels: the
    masses of blocks of ``_DRAW_BLOCK`` tokens (one vectorised reduction), the block that holds the
    draw, then the running sum inside that block only; 0.3 ms.
    """
    dtype = _draw_dtype(probs.device)
    rows, vocab = probs.shape
    n_blocks = -(-vocab // _DRAW_BLOCK)
    if vocab % _DRAW_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, n_blocks * _DRAW_BLOCK - vocab))  # zero mass
    blocks = probs.view(rows, n_blocks, _DRAW_BLOCK)
    mass = blocks.sum(-1, dtype=dtype)  # (B, NB)
    cdf = mass.cumsum(-1)  # (B, NB)
    if uniform is None:
        uniform = torch.rand(rows, 1, dtype=dtype, device=probs.device, generator=generator)
    u = uniform * cdf[:, -1:]  # (B, 1)
    block = _invert(cdf, u)  # (B, 1)
    u = u - (cdf.gather(1, block) - mass.gather(1, block))  # the draw's offset inside its block
    inner = blocks.gather(1, block[:, :, None].expand(rows, 1, _DRAW_BLOCK))[:, 0].to(dtype).cumsum(-1)
    return (block * _DRAW_BLOCK + _invert(inner, u)).squeeze(1)  # (B,)


def _draw_dtype(device: torch.device) -> torch.dtype:
    # float64 so that small probabilities keep their share of the mass in the running sums.
    return torch.float32 if device.type == "mps" else torch.float64


def _row_uniforms(seeds: list[int], steps: int, device: torch.device) -> torch.Tensor:
    """(B, steps) the numbers each row draws at each step, from a generator seeded with its own seed."""
    return torch.stack(
        [
            torch.rand(
                steps,
                dtype=_draw_dtype(device),
                device=device,
                generator=torch.Generator(device=device).manual_seed(seed),
            )
            for seed in seeds
        ]
    )


def _invert(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, 1) index of the first entry of each row of ``cdf`` (B, N) above ``u`` (B, 1).

    right=True never lands on a zero-mass entry (its running sum equals its predecessor's). Rounding
    can leave ``u`` at or above the row's total; that draw goes to the last entry with mass, never
    to a zero-mass one after it (a masked or padding token).
    """
    index = torch.searchsorted(cdf, u, right=True)
    last = (cdf < cdf[:, -1:]).sum(-1, keepdim=True)  # first entry at the total: the last with mass
    return torch.minimum(index, last)


class HFGenerationEngine:
    """Generates with a plain (unsharded) transformers model that it owns."""

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 64):
        # A causal LM of transformers (trainer.models.load_model's, which annotates it as a plain module).
        self.model = cast("PreTrainedModel", model).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = eos
        for p in self.model.parameters():
            p.requires_grad_(False)
        # bf16 on a CPU that oneDNN supports: linear weights prepacked (faster decode steps, bench/README.md).
        self._packed = onednn_linear.available(self.model) and onednn_linear.pack(self.model, batch_size) > 0
        forward_args = inspect.signature(self.model.forward).parameters
        # Older transformers (and some remote-code models) place cache writes by cache_position;
        # newer ones track the position inside the cache and no longer take the argument.
        self._takes_cache_position = "cache_position" in forward_args
        self._takes_logits_to_keep = "logits_to_keep" in forward_args
        # Whether the static-cache path works for this model: None until the first batch has tried it.
        attn = getattr(self.model.config, "_attn_implementation", None)
        self._static_cache: bool | None = None if attn in _STATIC_CACHE_ATTN else False
        # An MoE model's routers, recorded when a call asks for its routes (SamplingParams.routes); None: dense.
        self._routing = moe.install(self.model)
        self._prefilled_every_row = (
            False  # whether the last prefill ran every sample row (not distinct prompts)
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        # generate() rejected these; the loop would otherwise sample at temperature 1 or keep everything.
        if params.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0 <= params.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {params.top_p}")
        flat = [p for p in prompts for _ in range(n)]
        params.prompt_seeds(len(prompts))  # ValueError when seeds per prompt do not match the prompts
        # Seeds per prompt: each row's own stream (sample j of prompt i: seeds[i] + j, vLLM's rule for n).
        row_seeds = None if params.seeds is None else [s + j for s in params.seeds for j in range(n)]
        # A seed for the call draws from a generator of this call's own, seeded as torch.manual_seed would
        # seed the device's default one (the same numbers), without resetting the process's random state.
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        # Similar lengths in one batch waste less compute on padding; restore the order afterwards. The
        # sort is stable, so the samples of a prompt stay together and share one prefill.
        order = sorted(range(len(flat)), key=lambda i: len(flat[i]))
        done: dict[int, Completion] = {}
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            batch_seeds = None if row_seeds is None else [row_seeds[i] for i in idx]
            routing = self._routing if params.routes else None
            try:
                with moe.calling(self.model, moe.Call(record=routing is not None)):
                    batch = self._generate_batch(
                        [flat[i] for i in idx], params, generator, batch_seeds, routing
                    )
            finally:
                with moe.calling(self.model, moe.Call()):  # later forwards record nothing
                    moe.begin(self.model)
            done.update(zip(idx, batch))
        out = [done[i] for i in range(len(flat))]
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
        row_seeds: list[int] | None = None,
        routing: moe.Routing | None = None,
    ) -> list[Completion]:
        """Completions of ``prompts`` (one row each), drawn from ``generator``, or each row from its own seed;
        with ``routing`` (an MoE model's, recording), each with its routes: the prefill's over the prompt, then
        each decode step's over the token it fed (:attr:`Completion.routes`)."""
        if params.max_new_tokens <= 0:
            return [Completion([], [], "", "length") for _ in prompts]
        device, batch, max_new = self.device, len(prompts), params.max_new_tokens
        uniforms = None  # (B, max_new)
        if row_seeds is not None and not params.greedy:
            uniforms = _row_uniforms(row_seeds, max_new, device)
        # The distinct prompts, left-padded; samples of one prompt share a single prefill.
        input_ids, prompt_mask, row_ids = distinct_prompts(prompts, self.pad_id)  # (U, W), (U, W), (B,)
        width = input_ids.shape[1]
        rows = torch.tensor(row_ids, device=device)
        input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
        position_ids = (prompt_mask.cumsum(1) - 1).clamp(min=0)  # (U, W)
        # The last sampled token is never fed back, so the cache needs width + max_new - 1 columns.
        cache_len = width + max_new - 1
        capacity = min(width + _CACHE_CHUNK, cache_len)  # columns allocated in a static cache
        if routing is not None:
            moe.begin(self.model)
        logits, cache = self._prefill(input_ids, prompt_mask, position_ids, rows, capacity)  # (B, V)
        prompt_routes = None  # (B, W, layers, k)
        if routing is not None:
            routes = moe.take_routes(routing)
            every = self._prefilled_every_row
            prompt_routes = routes.reshape(
                len(rows) if every else input_ids.shape[0], width, *routes.shape[1:]
            )
            if not every:
                prompt_routes = prompt_routes[rows.cpu().numpy()]
        step_routes: list[np.ndarray] = []  # (B, layers, k): the token each decode step fed
        static = bool(self._static_cache)

        attention_mask = torch.zeros((batch, cache_len), dtype=torch.long, device=device)
        attention_mask[:, :width] = prompt_mask[rows]
        next_position = position_ids[rows, -1] + 1  # (B,) position of the first generated token
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=device)
        running = torch.ones(batch, dtype=torch.bool, device=device)  # (B,)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,) ended by EOS or a stop string
        lengths = torch.zeros(batch, dtype=torch.long, device=device)  # (B,)
        tokens: list[torch.Tensor] = []  # each (B,)
        logprobs: list[torch.Tensor] = []  # each (B,)
        generated: list[list[int]] = [[] for _ in range(batch)]  # ids on the host, only for stop strings
        window = max((len(s) for s in params.stop_strings), default=0) + 2
        for step in range(max_new):
            if step:
                column = width + step - 1  # where the previous token's keys/values go
                if static and column >= capacity:
                    capacity = min(capacity + _CACHE_CHUNK, cache_len)
                    _resize_static_cache(cache, capacity)
                attention_mask[:, column] = 1
                position = (next_position + step - 1)[:, None]  # (B, 1)
                mask = attention_mask[:, : column + 1]  # (B, W + step): prompt and generated columns
                out = self._forward(tokens[-1][:, None], mask, position, cache, column)
                logits = out.logits[:, -1].float()  # (B, V)
                if routing is not None:
                    step_routes.append(moe.take_routes(routing))
            uniform = None if uniforms is None else uniforms[:, step : step + 1]  # (B, 1)
            token, logprob = _sample(logits, params, generator, uniform)
            # Finished rows are fed a pad token; what they sample is ignored.
            token = torch.where(running, token, torch.full_like(token, self.pad_id))
            tokens.append(token)
            logprobs.append(logprob)
            lengths += running
            finished = running & torch.isin(token, eos)
            if params.stop_strings:
                check = running & ~finished
                finished |= self._stop_string_rows(token, check, generated, params.stop_strings, window)
            stopped |= finished
            running &= ~finished
            if not bool(running.any()):
                break

        new = torch.stack(tokens, dim=1).cpu()  # (B, L)
        new_logprobs = torch.stack(logprobs, dim=1).float().cpu()  # (B, L)
        completions = []
        for row, (length, stop) in enumerate(zip(lengths.tolist(), stopped.tolist())):
            ids = new[row, :length].tolist()  # an EOS is kept: the policy learns to stop
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            raw = parser_text(self.tokenizer, ids, stop and bool(ids) and ids[-1] in self.eos_ids)
            reason = "stop" if stop else "length"
            completions.append(Completion(ids, new_logprobs[row, :length].tolist(), text, reason, raw))
        if (
            prompt_routes is not None
        ):  # the prompt's real columns (left-padded), then every token fed but the last
            for row, c in enumerate(completions):
                p, fed = int(prompt_mask[rows[row]].sum()), step_routes[: max(len(c.token_ids) - 1, 0)]
                c.routes = np.concatenate([prompt_routes[row, width - p :], *(s[row][None] for s in fed)])
        return completions

    def _stop_string_rows(
        self,
        token: torch.Tensor,
        check: torch.Tensor,
        generated: list[list[int]],
        stop_strings: list[str],
        window: int,
    ) -> torch.Tensor:
        """(B,) rows whose newest token completes one of ``stop_strings``.

        Like HF's StopStringCriteria, a row stops when a stop string overlaps its last token, even if that
        token runs past the end of the string; unlike it, the prompt is not part of the text. Only the
        completion's last ``window`` tokens are decoded (each token is at least one character, so any
        stop string ending in the last token fits), and a string already present without the last
        token does not count: generation would have stopped there.
        """
        hits = torch.zeros_like(check)
        new = token.tolist()
        for row in check.nonzero().flatten().tolist():
            ids = generated[row]
            ids.append(new[row])
            tail = self.tokenizer.decode(ids[-window:])
            if not any(s in tail for s in stop_strings):
                continue
            before = self.tokenizer.decode(ids[-window:-1])
            if any(s in tail and s not in before for s in stop_strings):
                hits[row] = True
        return hits

    def _forward(self, input_ids, attention_mask, position_ids, cache, start: int):
        """One forward pass over ``input_ids`` (B, T) that writes keys/values at columns start..start+T-1."""
        kwargs = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1  # the prefill needs the last column only, not (B, W, V)
        if self._takes_cache_position:
            length = input_ids.shape[1]
            kwargs["cache_position"] = torch.arange(start, start + length, device=input_ids.device)
        return self.model(**kwargs)

    def _prefill(self, input_ids, attention_mask, position_ids, rows: torch.Tensor, capacity: int):
        """Prefill the distinct prompts (U, W) once; logits (B, V) and a cache of B = len(rows) rows.

        The first batch tries a StaticCache (given ``capacity`` columns) and remembers whether its rows
        could be expanded; if not, later batches go straight to a DynamicCache, whose layers know how
        to select batch rows.
        """
        self._prefilled_every_row = False
        if self._static_cache is not False:
            try:
                from transformers import StaticCache
                from transformers.cache_utils import StaticLayer

                cache = StaticCache(config=self.model.config, max_cache_len=input_ids.shape[1])
                out = self._forward(input_ids, attention_mask, position_ids, cache, 0)
                expanded = _is_plain_static_cache(cache, StaticLayer)
                if expanded:
                    _resize_static_cache(cache, capacity, rows)
            except Exception:
                if self._static_cache:  # it worked before: this is a real error, not an unsupported model
                    raise
                expanded = False
            self._static_cache = expanded
            if expanded:
                return out.logits[:, -1].float()[rows], cache
        out = self._forward(input_ids, attention_mask, position_ids, None, 0)
        cache = out.past_key_values
        try:
            cache.batch_select_indices(rows)
            return out.logits[:, -1].float()[rows], cache
        except (AttributeError, NotImplementedError, TypeError):
            # A cache that cannot select rows: prefill every row, shared prompts included.
            self._prefilled_every_row = True
            out = self._forward(input_ids[rows], attention_mask[rows], position_ids[rows], None, 0)
            if out.past_key_values is None:
                raise RuntimeError(f"{type(self.model).__name__} returned no KV cache") from None
            return out.logits[:, -1].float(), out.past_key_values

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, tensor in named_tensors:
            target = params.get(name)
            if target is None:
                raise KeyError(f"update_weights: the generation model has no tensor {name!r}")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        if self._packed:
            onednn_linear.repack(self.model)

    @torch.no_grad()
    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """LoRA: the adapters are applied, not merged (the model carries the same peft layers as the
        policy): each new tensor is copied into its adapter; the base weights stay."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            target = params.get(name)
            if target is None:
                raise KeyError(f"update_adapter: the generation model has no adapter tensor {name!r}")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        if self._packed:  # the adapters' own linears are packed too (bf16 on CPU)
            onednn_linear.repack(self.model)

    # The model lives in this process's memory and nothing can be freed while keeping it: no-ops.
    reloads_every_weight = False

    def sleep(self) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _is_plain_static_cache(cache, static_layer: type) -> bool:
    """Whether every layer of ``cache`` is a plain StaticLayer, the only kind _resize_static_cache knows.

    Their whole batch state is ``keys``/``values`` (U, heads, max_len, dim), ``batch_size`` and
    ``max_cache_len``, the write position being shared by all rows. Other layers (sliding windows,
    linear attention, indexers) or offloading keep state this does not know about.
    """
    layers = getattr(cache, "layers", None)
    if not layers or getattr(cache, "offloading", False):
        return False
    for layer in layers:
        if type(layer) is not static_layer or not hasattr(layer, "batch_size"):
            return False
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.dim() != 4:
            return False
        if not isinstance(getattr(layer, "max_cache_len", None), int):
            return False
    return True


def _resize_static_cache(cache, length: int, rows: torch.Tensor | None = None) -> None:
    """Reallocate a plain static cache to ``length`` columns, keeping what it holds.

    With ``rows`` (B,), row i of the result is a copy of row ``rows[i]``: the samples of a prompt get
    rows of their own, written independently, never views of one another.
    """
    for layer in cache.layers:
        for name in ("keys", "values"):
            old = getattr(layer, name)  # (U, heads, max_len, dim)
            if rows is not None:
                old = old.index_select(0, rows)  # (B, heads, max_len, dim)
            new = old.new_zeros(old.shape[0], old.shape[1], length, old.shape[3])
            keep = min(length, old.shape[2])
            new[:, :, :keep] = old[:, :, :keep]
            setattr(layer, name, new)
        layer.batch_size = layer.keys.shape[0]
        layer.max_cache_len = length

"""The generation contract every backend passes, on the same tiny model: hf and vllm (real vLLM on CPU).

One engine per backend for the whole module (a vLLM start costs seconds; compiled, half a minute). Oracles are a plain
transformers forward in float32 on the same tokens: engine logprobs must agree within ``TOL``, the
engine's own float32 rounding (vLLM's fused q/k/v and gate/up matmuls, the hf engine's static cache).
The tiny model ties its embedding to the lm_head, which is what makes the weight-update test bite: an
engine whose lm_head kept its own copy of the embedding (vLLM's packed CPU kernels do) would fail it.
"""

from __future__ import annotations

import os

import pytest
import torch

from trainer.config import GenerationConfig
from trainer.generation.base import SamplingParams

TOL = 1e-4  # max |engine logprob - transformers logprob|, float32 on both sides
MAX_MODEL_LEN = 512
# the vLLM engines are sized for calls of this many sequences (their KV cache on CPU); larger calls run in turns
SEQUENCES = 8
LONG_PROMPT = 300  # tokens: longer than one KV-cache block, so the prefix cache holds whole blocks of it


def _children() -> set[int]:
    """This process's descendants, less the session's Ray instance and all it starts, when this xdist worker
    holds it (tests.ray_process, ``ray.init`` in its command line): workers for the other xdist workers'
    runs come and go under it meanwhile."""
    import psutil

    out: set[int] = set()
    for child in psutil.Process().children():
        try:
            if "ray.init(" not in " ".join(child.cmdline()):
                out |= {child.pid} | {p.pid for p in child.children(recursive=True)}
        except psutil.NoSuchProcess:
            continue
    return out


def _shutdown(engine) -> None:
    shutdown = getattr(engine, "shutdown", None)  # the hf engine owns no process and may have none
    if shutdown is not None:
        shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(
    scope="module",
    params=[
        "hf",
        pytest.param("vllm", marks=pytest.mark.vllm),
        pytest.param("vllm-compiled", marks=pytest.mark.vllm),
    ],
)
def engine(request, tiny_model_path, tokenizer):
    before = _children()
    if request.param == "hf":
        from transformers import AutoModelForCausalLM

        from trainer.generation.hf import HFGenerationEngine

        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        built = HFGenerationEngine(model, tokenizer, batch_size=16)
    else:
        from trainer.generation.vllm_engine import VLLMGenerationEngine, engines_started

        if request.param == "vllm-compiled" and engines_started():
            pytest.skip(
                "a compiled CPU engine must be its process's first: test_vllm_compiled.py runs it alone"
            )
        # vllm-compiled: torch.compile (inductor) on CPU, where weights must still reach the compiled graph.
        gen = GenerationConfig(enforce_eager=request.param == "vllm")
        built = VLLMGenerationEngine(
            tiny_model_path,
            gen,
            "float32",
            seed=0,
            max_model_len=MAX_MODEL_LEN,
            threads=1,
            sequences=SEQUENCES,
        )
    built.children_before = before
    yield built
    _shutdown(built)  # a second call when the last test already shut it down: must be harmless


def _reference_logprobs(model, prompt: list[int], ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """(L,) logprob of each of ``ids`` after ``prompt`` under softmax(logits / temperature)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()  # (L, V)
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode("1+1="), tokenizer.encode("what is 2+2? answer:")]


def test_should_return_n_samples_with_ids_logprobs_and_reasons_when_asked_for_n(engine, tokenizer):
    prompts, n, max_new = _prompts(tokenizer), 3, 8
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=7)
    out = engine.generate(prompts, n, params)
    assert len(out) == len(prompts) and all(len(samples) == n for samples in out)
    eos = tokenizer.eos_token_id
    for samples in out:
        assert len({tuple(c.token_ids) for c in samples}) > 1  # n samples, not one repeated
        for c in samples:
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= max_new
            assert all(lp <= 0 for lp in c.logprobs)
            assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
            assert c.finish_reason == "stop" or len(c.token_ids) == max_new
            assert eos not in c.token_ids[:-1]
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    again = engine.generate(prompts, n, params)
    assert [[c.token_ids for c in s] for s in again] == [[c.token_ids for c in s] for s in out]  # same seed


def test_should_draw_each_prompts_samples_from_its_own_seed_when_seeded_per_prompt(engine, tokenizer):
    prompts = _prompts(tokenizer) + [tokenizer.encode("3*3=")]

    def draw(seeds, n=2, which=prompts):
        out = engine.generate(which, n, SamplingParams(max_new_tokens=10, temperature=1.0, seeds=seeds))
        return [[c.token_ids for c in samples] for samples in out]

    first = draw([11, 12, 13])
    assert draw([11, 12, 13]) == first
    moved = draw([11, 99, 13])  # only the second prompt's seed changes: only its samples may
    assert moved[0] == first[0] and moved[2] == first[2] and moved[1] != first[1]
    assert draw([12, 11, 13])[0] != first[0]
    # Sample j of a prompt draws from its seed + j, as a prompt of its own with that seed would.
    assert draw([12], n=1, which=prompts[:1])[0] == first[0][1:]


def test_should_refuse_seeds_that_do_not_match_the_call(engine, tokenizer):
    prompts = _prompts(tokenizer)
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        engine.generate(prompts[:1], 1, SamplingParams(max_new_tokens=2, seeds=[1, 2]))
    with pytest.raises(ValueError, match="both set"):
        engine.generate(prompts, 1, SamplingParams(max_new_tokens=2, seed=1, seeds=[1, 2]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_should_agree_with_a_transformers_forward_when_scoring_its_own_samples(
    engine, reference, tokenizer, temperature
):
    prompts = _prompts(tokenizer)
    out = engine.generate(prompts, 2, SamplingParams(max_new_tokens=12, temperature=temperature, seed=1))
    for prompt, samples in zip(prompts, out):
        for c in samples:
            expected = _reference_logprobs(reference, prompt, c.token_ids, temperature)
            assert (expected - torch.tensor(c.logprobs)).abs().max().item() < TOL


def test_should_pick_the_argmax_when_greedy(engine, reference, tokenizer):
    prompt = _prompts(tokenizer)[1]
    ((c,),) = engine.generate([prompt], 1, SamplingParams(max_new_tokens=10, temperature=0.0))
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
    assert c.token_ids == logits.argmax(-1).tolist()


def test_should_stop_at_the_token_that_completes_a_stop_string(engine, tokenizer):
    stops = ["1", "a", "e", "+"]  # one-character tokens: each completes at a single token
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, stop_strings=stops)
    out = engine.generate(_prompts(tokenizer), 4, params)
    stopped = 0
    for c in (c for samples in out for c in samples):
        hit = [s for s in stops if s in c.text]
        if hit:
            stopped += 1
            assert c.finish_reason == "stop" and any(c.text.endswith(s) for s in stops)
            assert not any(s in c.text[:-1] for s in stops)  # it stopped at the first one
    assert stopped >= 4  # 8 samples of up to 40 characters from a ~60-character vocabulary


def test_should_generate_as_before_when_put_to_sleep_and_woken_in_the_refits_order(
    engine, reference, tokenizer
):
    """The colocated refit's calls (trainer/policy/worker.py): every engine takes them, vLLM on CPU keeping
    the state only; an engine asked to load or generate while asleep wakes what that needs itself."""
    prompt = _prompts(tokenizer)[1]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    ((before,),) = engine.generate([prompt], 1, greedy)
    same = [
        (name, p.detach().clone()) for name, p in reference.named_parameters()
    ]  # the engine's own weights
    engine.sleep()
    engine.sleep()  # idempotent
    engine.wake_up(tags=["weights"])
    engine.update_weights(iter(same))
    engine.wake_up(tags=["kv_cache"])
    ((after,),) = engine.generate([prompt], 1, greedy)
    assert after.token_ids == before.token_ids
    engine.sleep()
    engine.update_weights(iter(same))  # asleep: the weights wake, the KV cache stays asleep
    assert getattr(engine, "asleep", ("kv_cache",)) == ("kv_cache",)
    ((woken,),) = engine.generate([prompt], 1, greedy)  # asleep: it wakes itself first
    assert woken.token_ids == before.token_ids
    assert getattr(engine, "asleep", ()) == ()


def test_should_follow_new_weights_when_updated_including_a_tied_embedding_and_a_cached_prefix(
    engine, reference, tokenizer
):
    torch.manual_seed(0)
    long_prompt = torch.randint(4, len(tokenizer), (LONG_PROMPT,)).tolist()
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    ((before,),) = engine.generate([long_prompt], 1, greedy)  # fills the prefix cache with the old weights
    original = {name: p.detach().clone() for name, p in reference.named_parameters()}  # no lm_head: tied
    assert "lm_head.weight" not in original
    perturbed = {
        # The embedding moves by far more than the rest: a stale lm_head copy would show at once.
        name: t + (0.5 if "embed_tokens" in name else 0.02) * torch.randn_like(t)
        for name, t in original.items()
    }
    try:
        engine.update_weights(iter(perturbed.items()))
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(perturbed[name])
        ((after,),) = engine.generate([long_prompt], 1, greedy)
        expected = _reference_logprobs(reference, long_prompt, after.token_ids)
        assert (expected - torch.tensor(after.logprobs)).abs().max().item() < TOL
        with torch.no_grad():
            logits = reference(torch.tensor([long_prompt + after.token_ids])).logits[0, LONG_PROMPT - 1 : -1]
        assert after.token_ids == logits.argmax(-1).tolist()
        assert (after.token_ids, after.logprobs) != (before.token_ids, before.logprobs)
    finally:  # the module's other tests share this engine and reference
        engine.update_weights(iter(original.items()))
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(original[name])
    ((restored,),) = engine.generate([long_prompt], 1, greedy)
    assert restored.token_ids == before.token_ids
    assert max(abs(a - b) for a, b in zip(restored.logprobs, before.logprobs)) < TOL


def test_should_hold_one_tokenizer_in_a_vllm_engine_and_load_no_processor(engine, tiny_model_path):
    """vLLM's renderer pools deep copies of its tokenizer for its asynchronous server, and its warm-up loads
    the model's processor to look for a chat template; kuberl's engine keeps one tokenizer and gives the
    model's own template (0.7 GiB of host memory per engine at Gemma 3's 262k vocabulary)."""
    if engine.__class__.__name__ != "VLLMGenerationEngine":
        pytest.skip("vLLM's renderer only")
    from vllm.renderers import hf as renderers
    from vllm.tokenizers.hf import ThreadSafeHFTokenizerMixin

    assert not isinstance(engine.tokenizer, ThreadSafeHFTokenizerMixin)
    assert not [key for key in renderers._PROCESSOR_CHAT_TEMPLATES if key[0] == tiny_model_path]


def test_should_size_a_cpu_engines_kv_cache_to_the_sequences_of_one_call(engine, tiny_model_path):
    if engine.__class__.__name__ != "VLLMGenerationEngine":
        pytest.skip("vLLM's KV cache only")
    from transformers import AutoConfig

    from trainer.generation.vllm_cpu import kv_bytes_per_token, step_kv_bytes

    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(tiny_model_path), "float32")
    want = step_kv_bytes(per_token, SEQUENCES, MAX_MODEL_LEN)
    assert want is not None and want < 2**30
    assert engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == want
    # more sequences than the cache holds at once run in turns, with the same contract
    out = engine.generate(_prompts(engine.tokenizer) * 6, 4, SamplingParams(max_new_tokens=4, seed=3))
    assert [len(samples) for samples in out] == [4] * 12


def test_should_find_vllms_model_info_in_the_shared_cache_and_keep_compile_caches_private(engine):
    """A CPU engine's private VLLM_CACHE_ROOT links the machine's model-info cache, so an engine after the
    first skips vLLM's inspection subprocess (a second vLLM import); the root, the engine's own directory
    (its sockets' and file store's too), goes at shutdown."""
    from pathlib import Path

    import vllm.envs

    from trainer.generation.vllm_cpu import shared_modelinfo_dir

    if getattr(engine, "_private_dir", None) is None:
        pytest.skip("the hf engine has no vLLM caches")
    root, shared = Path(engine._private_dir), Path(shared_modelinfo_dir())
    assert vllm.envs.VLLM_CACHE_ROOT == vllm.envs.VLLM_RPC_BASE_PATH == str(root)
    assert (root / "modelinfos").is_symlink() and (root / "modelinfos").resolve() == shared.resolve()
    assert list(shared.glob("*-LlamaForCausalLM.json"))  # written by the first engine, read by the next
    _shutdown(engine)
    assert not root.exists() and list(shared.glob("*-LlamaForCausalLM.json"))
    # what this process starts next (an engine, a `vllm serve` inheriting its environment) is not sent there
    assert str(root) not in {os.environ.get("VLLM_RPC_BASE_PATH"), os.environ.get("VLLM_CACHE_ROOT")}


def test_should_leave_no_child_process_when_shut_down(engine):
    _shutdown(engine)
    _shutdown(engine)  # idempotent
    assert _children() <= engine.children_before


@pytest.mark.vllm
def test_should_leave_no_child_process_when_a_vllm_engine_fails_after_it_started(
    tiny_model_path, monkeypatch
):
    import vllm.envs

    from trainer.generation.vllm_engine import VLLMGenerationEngine

    seen = {}

    def broken(self):
        seen.update(own=self._private_dir, cache=vllm.envs.VLLM_CACHE_ROOT, rpc=vllm.envs.VLLM_RPC_BASE_PATH)
        raise RuntimeError("injected after vLLM started")

    monkeypatch.setattr(VLLMGenerationEngine, "_hf_text_config", broken)  # runs once vllm.LLM is up
    # As after an earlier engine in this process: vLLM caches its environment once an engine has started.
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/nonexistent/an-earlier-engines-directory")
    vllm.envs.enable_envs_cache()
    before = _children()
    try:
        with pytest.raises(RuntimeError, match="injected"):
            VLLMGenerationEngine(
                tiny_model_path, GenerationConfig(), "float32", seed=0, max_model_len=128, threads=1
            )
    finally:
        vllm.envs.disable_envs_cache()
    assert _children() <= before
    # It read its own directory, not the cached one, and the failed start removed it.
    assert seen["cache"] == seen["rpc"] == seen["own"] and not os.path.exists(seen["own"])

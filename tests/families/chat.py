"""Real model families' chat formats, written here from each format's published behaviour (roles, turn-end
token, system and tool handling, think handling), with a tokenizer that carries the family's special tokens.

Each :class:`Family` has a Jinja chat template and a character-level tokenizer: one token per printable
character, plus the family's special tokens (split from the text before anything else, as real tokenizers
do) and its non-special added tokens. The templates keep what decides multi-turn glue: where a turn ends and
with which token, what a tool result is wrapped in, whether the system turn stands alone, whether earlier
turns are rewritten (Qwen3 drops their ``<think>`` blocks) and whether roles must alternate (Gemma raises on
any other order). They are not the families' files: the tests hold the trainer to the behaviour, not to a copy.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

CHARS = string.printable  # letters of both cases, digits, punctuation, whitespace


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    bos: str | None  # written by the template at the start (not added again when tokenizing)
    eos: str  # the tokenizer's EOS
    turn_end: str  # the token that ends an assistant turn in the template
    specials: tuple[str, ...]  # special tokens (control tokens)
    added: tuple[str, ...] = ()  # added tokens that are not special (Qwen's <tool_call>, <think>)
    tool_role: bool = True  # the template renders role "tool" (else it refuses it)
    rewrites_history: bool = False
    pad: str = "<pad>"
    extra: dict = field(default_factory=dict)


# ChatML with tool results as user turns of <tool_response> blocks (Qwen2.5, Qwen3, Hermes).
_CHATML_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- \'\\n</tools>\\n\\nCall a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- elif default_system %}{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}{%- endif %}"
)

_CHATML_TOOL_TURN = (
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
)

QWEN25_TEMPLATE = (
    "{%- set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}"
    + _CHATML_TOOLS
    + "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role in ('user', 'system') or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}" + _CHATML_TOOL_TURN + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3: the assistant turns after the last real user turn keep a <think> block (an empty one when the turn
# has none, for the last turn); earlier assistant turns lose theirs. enable_thinking=false opens the generation
# prompt with an empty think block.
QWEN3_TEMPLATE = (
    "{%- set default_system = none %}"
    + _CHATML_TOOLS
    + "{%- set ns = namespace(last_query=messages | length - 1, found=false) %}"
    "{%- for message in messages[::-1] %}{%- set i = messages | length - 1 - loop.index0 %}"
    "{%- if not ns.found and message.role == 'user' and not message.content.startswith('<tool_response>') %}"
    "{%- set ns.last_query = i %}{%- set ns.found = true %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role in ('user', 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}" + _CHATML_TOOL_TURN + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

SMOLLM2_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message.role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1: a header per turn, content trimmed, <|eot_id|> ends every turn; tool results are role ipython.
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n\\n' + system }}"
    '{%- if tools %}{{- \'\\n\\nYou may call these functions, answering with JSON {"name": ..., "parameters": ...}:\' }}'
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- for message in rest %}"
    "{%- if message.role in ('tool', 'ipython') %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + (message.content | trim) + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + (message.content | trim) + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Gemma 3: <bos>, then user and model turns that must alternate (the system text opens the first user turn);
# any other role is refused. A turn ends with <end_of_turn>, while the tokenizer's EOS is <eos>.
GEMMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set first = messages[0].content + '\\n\\n' %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set first = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- for message in rest %}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + (message.content | trim) + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

# Mistral (tekken-era instruct): [INST]...[/INST] for users, the answer then </s>; tool results in
# [TOOL_RESULTS]...[/TOOL_RESULTS]; the system text goes into the last user turn.
MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = none %}{%- set rest = messages %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}{%- for m in rest %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in rest %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if system and loop.index0 == ns.last_user %}{{- '[INST]' + system + '\\n\\n' + message.content + '[/INST]' }}"
    "{%- else %}{{- '[INST]' + message.content + '[/INST]' }}{%- endif %}"
    "{%- elif message.role == 'assistant' %}{{- message.content + '</s>' }}"
    "{%- elif message.role == 'tool' %}{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('Only user, assistant and tool roles are supported') }}{%- endif %}"
    "{%- endfor %}"
)

# Granite 3: <|start_of_role|>role<|end_of_role|>content<|end_of_text|>, a newline between turns; tool
# results are role tool_response.
GRANITE_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = 'You are Granite, developed by IBM. You are a helpful AI assistant.' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|start_of_role|>system<|end_of_role|>' + system + '<|end_of_text|>\\n' }}"
    "{%- if tools %}{{- '<|start_of_role|>tools<|end_of_role|>' + (tools | tojson) + '<|end_of_text|>\\n' }}{%- endif %}"
    "{%- for message in rest %}"
    "{%- set role = 'tool_response' if message.role == 'tool' else message.role %}"
    "{{- '<|start_of_role|>' + role + '<|end_of_role|>' + message.content + '<|end_of_text|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)

_CHATML = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
_QWEN_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

FAMILIES = {
    "llama3": Family(
        "llama3", LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|python_tag|>"),
    ),
    "qwen2.5": Family("qwen2.5", QWEN25_TEMPLATE, None, "<|im_end|>", "<|im_end|>", _CHATML, _QWEN_ADDED),
    "qwen3": Family(
        "qwen3", QWEN3_TEMPLATE, None, "<|im_end|>", "<|im_end|>", _CHATML,
        (*_QWEN_ADDED, "<think>", "</think>"), rewrites_history=True,
    ),
    "gemma3": Family(
        "gemma3", GEMMA3_TEMPLATE, "<bos>", "<eos>", "<end_of_turn>",
        ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), tool_role=False,
    ),
    "mistral": Family(
        "mistral", MISTRAL_TEMPLATE, "<s>", "</s>", "</s>",
        ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
         "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
        rewrites_history=True,  # the system text moves to the newest user turn
    ),
    "granite": Family(
        "granite", GRANITE_TEMPLATE, None, "<|end_of_text|>", "<|end_of_text|>",
        ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
    ),
    "smollm2": Family("smollm2", SMOLLM2_TEMPLATE, None, "<|im_end|>", "<|im_end|>", _CHATML),
}  # fmt: skip
FAMILIES["qwen3-moe"] = FAMILIES["qwen3"]  # the same tokenizer and template as the dense models


def build_tokenizer(family: Family):
    """A ``PreTrainedTokenizerFast``: one token per printable character, the family's special and added
    tokens, its BOS, EOS and template. The turn markers are special added tokens only, not named among
    ``additional_special_tokens``: as in Gemma's tokenizer converted from GGUF, where ``all_special_ids`` holds
    just BOS, EOS, PAD, UNK and MASK."""
    from tokenizers import AddedToken as RawAddedToken
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys([family.pad, "<unk>", *family.specials]))
    vocab = {t: i for i, t in enumerate([*specials, *family.added, *dict.fromkeys(CHARS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([RawAddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([RawAddedToken(t, special=False, normalized=False) for t in family.added])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=family.pad,
        unk_token="<unk>",
        bos_token=family.bos or family.eos,
        eos_token=family.eos,
        chat_template=family.template,
    )

"""Prompt building: chat messages -> token ids through the tokenizer's chat template.

A run with tools (a multi-turn environment that offers them) passes their schemas to the template's own
``tools=`` support, on the first prompt and on every rendering of the glue between turns, so the template
lays out its tool prompt and its tool-response markers as the model was trained to read them.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


def encode_prompt(
    tokenizer,
    messages: list[dict[str, str]],
    chat_template_kwargs: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Render ``messages`` (and ``tools``, if any) with ``add_generation_prompt`` and tokenize (no second BOS)."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **_with_tools(chat_template_kwargs, tools)
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _with_tools(kwargs: dict[str, Any], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {**kwargs, "tools": tools} if tools else dict(kwargs)


def encode_examples(
    tokenizer,
    examples: list[dict],
    chat_template_kwargs: dict[str, Any],
    max_prompt_tokens: int,
    tools: list[dict[str, Any]] | None = None,
):
    """Token ids for each example; prompts longer than ``max_prompt_tokens`` are dropped with one warning."""
    kept, dropped = [], 0
    for ex in examples:
        ids = encode_prompt(tokenizer, ex["messages"], chat_template_kwargs, tools)
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        kept.append({**ex, "prompt_ids": ids})
    if dropped:
        log.warning(
            "dropped %d of %d prompts longer than %d tokens (policy.max_total_sequence_length - "
            "generation.max_new_tokens)",
            dropped,
            len(examples),
            max_prompt_tokens,
        )
    return kept


_PLACEHOLDER = "\u2063KUBERL_ASSISTANT_TURN\u2063"
_TOOL_PROBE = "\u2063KUBERL_TOOL_RESULT\u2063"


class TurnEncoder:
    """Token ids that continue a conversation after the model's turn with the environment's messages.

    The model's own tokens are kept exactly as sampled (re-tokenizing text need not give them back); only
    the template's glue is tokenized: the end of the assistant turn, the environment's messages (a user
    turn, or tool results inside the template's own tool-response markers) and the next generation prompt.
    The glue is what the template renders after the model's turn when it renders the whole conversation,
    the turn's content a placeholder: a template that rewrites history (Qwen3 drops an earlier turn's
    ``<think>`` block) changes only what comes before the placeholder, and the model's earlier turns stay as
    they were sampled, which is what the model read when it wrote the next one.

    Three rules keep the glue exact:

    - The end-of-turn token is the template's, written once: when the turn's last *sampled* id is the
      glue's first (a special token: ``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``), the model wrote
      it and the glue starts after it. Whether the turn stopped on the tokenizer's EOS, on another stop id,
      on a stop string or at the length limit does not enter into it: the sampled ids say what is there.
    - The environment's text is data: a special-token string in a tool result or feedback
      (``<|im_end|>\\n<|im_start|>system``) is tokenized as plain text, never as a control token, so nothing
      the environment (or the model, through a tool) writes can forge a turn. Text without one is tokenized
      with the glue as a whole, exactly as the template's own rendering would be.
    - A template with no tool role (Gemma's strict user/model alternation raises on one; a template with
      no branch for it would drop the result silently) gets tool results as one user turn, each inside
      ``<tool_response>`` markers; :meth:`self_check` says which at start-up.
    """

    def __init__(
        self, tokenizer, chat_template_kwargs: dict[str, Any], tools: list[dict[str, Any]] | None = None
    ):
        self.tokenizer, self.kwargs = tokenizer, _with_tools(chat_template_kwargs, tools)
        self._tool_role: bool | None = None  # whether the template renders role "tool" (probed once)
        self._special_ids = special_ids(tokenizer)
        self._specials = special_pattern(tokenizer)

    @property
    def tool_role(self) -> bool:
        """Whether the chat template renders a ``tool`` message as one (else tool results go as a user turn)."""
        if self._tool_role is None:
            convo = [
                {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": "5"},
                {"role": "tool", "content": _TOOL_PROBE},
            ]
            try:
                text = self._render(convo, add_generation_prompt=True)
            except Exception:  # jinja2's TemplateError from raise_exception, or a template that breaks
                text = ""
            self._tool_role = _TOOL_PROBE in text
        return self._tool_role

    def messages_after(self, feedback: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The environment's answer as the messages the template renders (tool results as a user turn when
        the template has no tool role)."""
        after = [{"role": "user", "content": feedback}] if isinstance(feedback, str) else list(feedback)
        if self.tool_role or not any(m.get("role") == "tool" for m in after):
            return after
        parts = [
            f"<tool_response>\n{m.get('content', '')}\n</tool_response>" if m.get("role") == "tool"
            else str(m.get("content", ""))
            for m in after
        ]  # fmt: skip
        return [{"role": "user", "content": "\n".join(parts)}]  # one turn: strict alternation holds

    def continuation(
        self, messages: list[dict[str, Any]], feedback: str | list[dict[str, Any]], sampled: Sequence[int]
    ) -> list[int]:
        """The glue after a model turn: ``feedback`` is the next user turn's text, or the messages to append
        (role "tool" or "user"); ``messages`` are the example's prompt messages; ``sampled`` the ids the model
        wrote in the turn (its last says whether the end-of-turn token is already there)."""
        after = self.messages_after(feedback)
        turn = [*messages, {"role": "assistant", "content": _PLACEHOLDER}]
        whole = self._render([*turn, *after], add_generation_prompt=True)
        if whole.count(_PLACEHOLDER) != 1:
            raise TemplateGlueError(
                "the chat template does not render an assistant turn's content as written, so the glue after "
                "a model turn cannot be found"
            )
        glue = whole[whole.index(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        ids = self._tokenize_glue(glue, turn, after)
        if sampled and ids and sampled[-1] == ids[0] and ids[0] in self._special_ids:
            ids = ids[1:]  # the model already wrote the end-of-turn token
        return ids

    def _render(self, conversation: list[dict[str, Any]], **kw) -> str:
        return self.tokenizer.apply_chat_template(conversation, tokenize=False, **self.kwargs, **kw)

    def _tokenize_glue(self, glue: str, turn: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[int]:
        """``glue`` as ids: the template's markup with its special tokens, the environment's text without
        (the class docstring). Honest text (no special-token string in it) is tokenized whole, as the
        template's own rendering would be."""
        tok = self.tokenizer
        texts = [m.get("content") for m in after]
        if not any(isinstance(t, str) and self._holds_special(t) for t in texts):
            return tok(glue, add_special_tokens=False)["input_ids"]
        # Render again with a marker in place of each text: what lies between the markers is the template's.
        # In the real rendering the texts sit between those pieces (changed or not: a template may trim
        # them), the first piece its start and the last its end.
        strings = [i for i, t in enumerate(texts) if isinstance(t, str)]
        marked = [{**m, "content": _env_marker(i)} if i in strings else m for i, m in enumerate(after)]
        whole = self._render([*turn, *marked], add_generation_prompt=True)
        shell = whole[whole.index(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        markup: list[str] = []
        for i in strings:
            head, sep, shell = shell.partition(_env_marker(i))
            if not sep:
                raise TemplateGlueError("the chat template does not render the environment's text as given")
            markup.append(head)
        markup.append(shell)
        if not glue.startswith(markup[0]) or not glue.endswith(markup[-1]):
            raise TemplateGlueError("cannot separate the environment's text from the chat template's markup")
        ids = tok(markup[0], add_special_tokens=False)["input_ids"]
        pos, stop = len(markup[0]), len(glue) - len(markup[-1])
        for piece in markup[1:]:
            # The text ends where the next piece starts (the last piece ends the glue). A text that copies a
            # piece of the template's markup can only move where it splits: all of it stays plain text.
            end = stop if piece is markup[-1] else glue.find(piece, pos, stop)
            if end < pos:
                raise TemplateGlueError(
                    "cannot separate the environment's text from the chat template's markup"
                )
            ids += tok(glue[pos:end], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            ids += tok(piece, add_special_tokens=False)["input_ids"]
            pos = end + len(piece)
        return ids

    def _holds_special(self, text: str) -> bool:
        return self._specials is not None and self._specials.search(text) is not None

    def self_check(self, messages: list[dict[str, Any]] | None = None) -> str:
        """A scripted two-turn conversation through :meth:`continuation`, against the template's own rendering
        of the whole conversation: the glue's ids must be the rendering's last ids, the same whether the turn
        ended on its end-of-turn token or at the length limit (or a stop string), and a tool result (an
        environment with tools) must reach the rendering. Returns the one ``self-check:`` line; raises
        :class:`TemplateGlueError` naming what failed."""
        tok = self.tokenizer
        messages = messages or [{"role": "user", "content": "What is 2+3?"}]
        answer = "The answer is 5."
        tools = bool(self.kwargs.get("tools"))
        feedback: list[dict[str, Any]] = (
            [{"role": "tool", "content": "5"}]
            if tools
            else [{"role": "user", "content": "Check it once more."}]
        )
        try:
            closed = self._render([*messages, {"role": "assistant", "content": answer}])
            after = self.messages_after(feedback)
            whole = self._render([*messages, {"role": "assistant", "content": answer}, *after],
                                 add_generation_prompt=True)  # fmt: skip
            glue_cut = self.continuation(messages, feedback, [])  # a turn cut at the length limit
        except TemplateGlueError:
            raise
        except Exception as e:  # jinja2's TemplateError: the template refuses this conversation
            raise TemplateGlueError(
                f"the chat template cannot render a model turn followed by the environment's answer "
                f"({type(e).__name__}: {e})"
            ) from e
        if answer not in closed:
            raise TemplateGlueError(
                "the chat template does not render an assistant turn's content as written"
            )
        ending = closed[closed.rindex(answer) + len(answer) :]
        end_ids = tok(ending, add_special_tokens=False)["input_ids"][:1]
        end = end_ids[0] if end_ids and end_ids[0] in self._special_ids else None
        sampled = tok(answer, add_special_tokens=False)["input_ids"] + ([end] if end is not None else [])
        glue_ended = self.continuation(messages, feedback, sampled)
        expected = tok(whole, add_special_tokens=False)["input_ids"]
        if end is not None and glue_cut != [end, *glue_ended]:
            raise TemplateGlueError(
                f"the glue after a turn ended by {tok.convert_ids_to_tokens(end)!r} is not the glue after a cut "
                "turn less that token"
            )
        if expected[len(expected) - len(glue_cut) :] != glue_cut:
            raise TemplateGlueError(
                "the glue's ids are not the end of the template's own rendering of the whole conversation "
                f"(glue {tok.decode(glue_cut)!r})"
            )
        if tools and "5" not in tok.decode(glue_cut):
            raise TemplateGlueError("a tool result does not reach the template's rendering")
        rewritten = not whole.startswith(
            closed
        )  # e.g. Qwen3 drops the turn's <think> block once a turn follows
        notes = [
            f"end of turn {tok.convert_ids_to_tokens(end)!r}" if end is not None else "no end-of-turn token",
        ]
        if tools:
            notes.append(
                "tool results as " + ("tool turns" if self.tool_role else "a user turn (no tool role)")
            )
        if rewritten:
            notes.append("the template rewrites earlier turns: they are trained as sampled")
        return (
            "self-check: chat template glue equals the template's own rendering of a two-turn conversation ("
            + "; ".join(notes)
            + ")"
        )


class TemplateGlueError(ValueError):
    """The chat template cannot glue an environment's answer after a model turn exactly (the message says why)."""


def special_ids(tokenizer) -> set[int]:
    """The ids of every special token: the named ones and the added tokens marked special (a family's turn
    markers: Gemma's ``<end_of_turn>`` is one of the latter only, not among ``all_special_ids``)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in decoder.items() if getattr(t, "special", False)}


def special_pattern(tokenizer) -> re.Pattern[str] | None:
    """One compiled pattern that finds the tokenizer's special-token strings (the named ones and the added
    tokens marked special) in a text, leftmost first and, where several start there, the longest (as the
    tokenizer itself splits them: ``<|im_start|>system`` before ``<|im_start|>``); None when it has none.

    A prefix tree, not an alternation: every environment message is scanned before it is tokenized, and with
    200 reserved tokens ``any(s in text ...)`` made 200 passes over the text (on a 2-core AMD EPYC, 11 us for
    200 characters, 0.5 ms for 2,000 ending in a forged turn, 1.8 ms for 20,000) and a plain alternation
    tried 200 strings at each ``<`` (1.4 ms on 2,000 characters of ``<|x|>``); the tree makes one pass and
    reads a few characters per candidate (0.2, 1.7 and 10 us; tests/data/test_special_scan.py measures it).
    Built once per set of strings."""
    strings = [*tokenizer.all_special_tokens, *_added_special_tokens(tokenizer)]
    return _prefix_tree(frozenset(str(t) for t in strings if str(t)))


@functools.lru_cache(maxsize=16)
def _prefix_tree(strings: frozenset[str]) -> re.Pattern[str] | None:
    """A regex that matches exactly ``strings``, longest first: a prefix tree whose every branching node is
    one alternation over distinct next characters, and where a string ends inside another the rest is
    optional (greedy: the longer string is tried first). Runs of one character are written out, so the
    nesting is the number of branching nodes on a path, not a string's length."""
    if not strings:
        return None
    tree: dict[str, dict] = {}
    for string in strings:
        node = tree
        for char in string:
            node = node.setdefault(char, {})
        node[""] = {}  # a string ends here

    def emit(node: dict[str, dict]) -> str:
        run = ""
        while len(node) == 1 and "" not in node:  # one next character and no string ending: no branch
            ((char, node),) = node.items()
            run += re.escape(char)
        branches = [re.escape(c) + emit(child) for c, child in sorted(node.items()) if c]
        if not branches:
            return run
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if "" in node:  # a string ends here: what follows is optional, tried first
            body = (f"(?:{body})" if len(branches) == 1 else body) + "?"
        return run + body

    return re.compile(emit(tree))


def _added_special_tokens(tokenizer) -> list[str]:
    """The added tokens marked special (a family's turn markers beside the named special tokens)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return [t.content for t in decoder.values() if getattr(t, "special", False)]


def _env_marker(i: int) -> str:
    return f"\u2063KUBERL_ENV_{i}\u2063"


class BosError(ValueError):
    """The run's prompts do not start with the BOS token the model needs (the message says what and the fix)."""


def check_bos(tokenizer, prompt_ids: Sequence[int], model_type: str | None = None) -> str:
    """The start-up check of a prompt's first token: one ``self-check:`` line, or :class:`BosError`.

    A model trained with a BOS token in front of every sequence needs it: Gemma without ``<bos>`` degenerates
    ("The capital of France is" -> " France. The The The..."), and a tokenizer converted from GGUF may not add it
    though the file says so. A model needs it when its tokenizer puts it in front of plain text, and Gemma always.
    Two BOS tokens (a template that writes one, a tokenizer that adds another) are refused as well."""
    bos = tokenizer.bos_token_id
    if bos is None or not prompt_ids:
        return "self-check: prompts start as the tokenizer starts them (it has no BOS token)"
    plain = tokenizer("a")["input_ids"]
    gemma = (model_type or "").startswith("gemma")
    wanted = bool(plain) and plain[0] == bos or gemma
    name = tokenizer.convert_ids_to_tokens(bos)
    if wanted and prompt_ids[0] != bos:
        why = f"{model_type} needs it" if gemma else "its tokenizer puts it in front of plain text"
        raise BosError(
            f"the prompts do not start with {name!r} ({why}): give a chat template that writes bos_token first"
        )
    if len(prompt_ids) > 1 and prompt_ids[0] == prompt_ids[1] == bos:
        raise BosError(
            f"the prompts start with {name!r} twice: the chat template writes it and so does the encoding"
        )
    if wanted:
        return f"self-check: prompts start with {name!r} once, as {model_type or 'the tokenizer'} expects"
    return f"self-check: prompts need no BOS token ({name!r} is not put in front of plain text)"

"""Getting a real model's tokenizer ready for RAPO's rollouts inside TRL: the tag check, its remedy, chat prompts.

What it is: `check_rapo_tags` (ValueError unless each tag is one token of the vocabulary, and of the steps a StepTraces
stored), `add_rapo_tags` (the one-call remedy) and `ChatFormat` (prompts and tool turns rendered by the chat template
as TRL renders prompts; learned steps back in the buffer's one form).
What it is not: a tokenizer, a tool-call parser (a tool call is the text between the tags), or TRL's tool calling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rapo_fast._tokens import encode_plain

__all__ = ["TAGS", "check_rapo_tags", "add_rapo_tags", "ChatFormat"]

TAGS = ("<tool>", "</tool>", "<retrieve>", "</retrieve>")
_REMEDY = (
    "call rapo_fast.integrations.trl.add_rapo_tags(tokenizer, model) before building the trainer (it adds the tags "
    "as tokens and resizes the model's embeddings)"
)


def _tag_problems(tokenizer: Any) -> dict[str, str]:
    """tag -> what is wrong with it, for each tag that is not a single, known token of `tokenizer`."""
    unk = getattr(tokenizer, "unk_token_id", None)
    out = {}
    for tag in TAGS:
        tid = tokenizer.convert_tokens_to_ids(tag)
        ids = encode_plain(tokenizer, tag)
        if tid is None or (unk is not None and tid == unk):
            out[tag] = f"{tag} is not in the vocabulary (id {tid}; encodes to {ids})"
        elif ids != [tid]:
            out[tag] = f"{tag} encodes to {ids}, not to its own id {tid}"
    return out


def check_rapo_tags(tokenizer: Any, who: str = "make_rollout_func", traces: Any = None) -> None:
    """Refuse a tokenizer the rollout cannot run with: the tags must each be one token (the rollout ends a tool step
    when it samples the id of </tool>: a missing tag would never end one, an unk-mapped tag would end one on every
    sampled unk), and eos and pad must be set. Given `traces` (a StepTraces), each stored step must open and close on
    the tag ids, which one built before add_rapo_tags does not (its tags are pieces the rollout never reads as tags)."""
    problems = _tag_problems(tokenizer)
    if problems:
        wrong = "; ".join(problems.values())
        raise ValueError(f"{who}: tokenizer: expected each tag of {TAGS} as one token, got {wrong}. {_REMEDY}")
    for name in ("eos_token_id", "pad_token_id"):
        if getattr(tokenizer, name, None) is None:
            raise ValueError(f"{who}: tokenizer: expected {name} set, got None")
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<retrieve>", "</retrieve>")]
    bad = [p for p, seg in (traces.payloads if traces is not None else {}).items() if [seg[0], seg[-1]] != ends]
    if bad:
        raise ValueError(
            f"{who}: traces: expected steps tokenized with each tag of {TAGS} as one token, got {len(bad)} of "
            f"{len(traces.payloads)} with the tags in pieces (payload {bad[0]} starts {traces.payloads[bad[0]][:4]}): "
            f"the StepTraces was built before add_rapo_tags; {_REMEDY}, then build the StepTraces"
        )


def add_rapo_tags(tokenizer: Any, model: Any = None) -> int:
    """Add the tags `check_rapo_tags` refuses as tokens of `tokenizer` and resize `model`'s token embeddings to the
    tokenizer's length; returns how many tags were added (0: nothing changed).

    They are added as normal (not special) tokens: TRL decodes completions with skip_special_tokens=True for the
    reward functions, which would drop special tokens' text. The new embedding rows are initialised by
    transformers' `resize_token_embeddings`. Call it before building the StepTraces and the trainer, so that both
    see the same vocabulary."""
    missing = list(_tag_problems(tokenizer))
    added = int(tokenizer.add_tokens(missing)) if missing else 0
    if model is not None and len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    problems = _tag_problems(tokenizer)
    if problems:
        wrong = "; ".join(problems.values())
        raise ValueError(f"add_rapo_tags: tokenizer: expected single-token tags once added, got {wrong}")
    return added


_SENT, _OBS = "\x00RAPO-STEP\x00", "\x00RAPO-OBS\x00"  # sentinels no template or task text contains
# chat_tool_turns=False keeps tool output inline in the assistant turn: no tool message to render
_CHAT_ERR = "rapo rollout_func: tokenizer.chat_template (or pass chat_tool_turns=False): expected"


@dataclass
class ChatFormat:
    """The chat template's rendering of a conversational prompt (a list of {"role", "content"} messages) and of a
    tool turn. `tool_prefix` + observation + `tool_suffix` is what the template puts between an assistant turn's end
    and the next assistant turn's start when a "tool" message comes in between (closing the assistant turn, the tool
    turn, the generation prompt), found by rendering one conversation with and without a tool message, as TRL does
    for its own tool calls. tool_turns=False keeps the observation inline in the assistant turn (empty prefix/suffix).
    """

    tokenizer: Any
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tool_turns: bool = True
    tool_prefix: str = ""
    tool_suffix: str = ""

    def __post_init__(self) -> None:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("rapo rollout_func: tokenizer.chat_template: expected one for chat prompts, got None")
        if self.tool_turns:
            self.tool_prefix, self.tool_suffix = self._tool_turn()

    def _render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=generation_prompt, tokenize=False, **dict(self.template_kwargs)
        )

    def _tool_turn(self) -> tuple[str, str]:
        turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENT}]
        try:
            text = self._render([*turn, {"role": "tool", "content": _OBS}], True)
        except Exception as exc:  # jinja raises whatever the template author chose
            raise ValueError(f"{_CHAT_ERR} a 'tool' message rendered, got {type(exc).__name__}: {exc}") from exc
        if text.count(_SENT) != 1 or text.count(_OBS) != 1 or text.index(_SENT) > text.index(_OBS):
            raise ValueError(f"{_CHAT_ERR} the tool message after the assistant's text, got another order")
        between = text[text.index(_SENT) + len(_SENT) :]
        prefix, suffix = between.split(_OBS)
        return prefix, suffix

    def prompt(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[int]]:
        """(the prompt's text, its token ids) as TRL tokenizes a conversational prompt: the template places its own
        special tokens, so none are added on top."""
        text = self._render(messages, True)
        return text, encode_plain(self.tokenizer, text)

    def tool_output(self, observation: str) -> str:
        return f"{self.tool_prefix}{observation}{self.tool_suffix}"

    def plain_step(self, step: str) -> str:
        """A learned step's text (generated up to its one `</tool>`, then the tool turn around the observation) in the
        buffer's one form, the form of the seed steps from JSONL: `... </tool> observation`, no template text."""
        head, sep, turn = step.partition("</tool>")
        turn = turn.strip().removeprefix(self.tool_prefix.strip()).removesuffix(self.tool_suffix.strip())
        return f"{head}{sep} {turn.strip()}"


class ChatEnv:
    """An env whose observations are wrapped in the chat template's tool turn (ChatFormat.tool_output)."""

    def __init__(self, env: Any, chat: ChatFormat) -> None:
        self.env, self.chat = env, chat

    def execute(self, call: str) -> str:
        return self.chat.tool_output(self.env.execute(call))

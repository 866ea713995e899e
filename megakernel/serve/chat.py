"""Chat prompts: a checkpoint's chat template applied to a user message, and the model's EOS.

An Instruct model answers a conversation laid out by its own template (the tokenizer's
`chat_template`, from tokenizer_config.json or a GGUF file's metadata) and ends its turn with its
EOS token; generation stops there and the text leaves special tokens out.
"""

from __future__ import annotations

from typing import Any

from megakernel.common.errors import UserError

Message = dict[str, str]


class ChatError(UserError, ValueError):
    """A chat request the model's tokenizer cannot serve (no tokenizer, no template, bad
    messages)."""


def load_tokenizer(spec: str) -> Any:
    """AutoTokenizer for a checkpoint directory or a GGUF file (from its metadata); ChatError
    when there is none."""
    from pathlib import Path

    from megakernel.models.gguf import gguf_tokenizer, is_gguf

    if is_gguf(spec):
        return gguf_tokenizer(spec)
    root = Path(spec)
    if not root.is_dir():
        raise ChatError(f"--prompt needs a checkpoint directory or GGUF file with a tokenizer; "
                        f"{spec!r} is a preset with random weights (use --prompt-ids)")
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((root / n).is_file() for n in names):
        raise ChatError(f"no tokenizer in {spec} (looked for {', '.join(names)}); use --prompt-ids")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ChatError(f"--prompt needs the transformers package ({e})") from None
    return AutoTokenizer.from_pretrained(str(root))


def chat_ids(tokenizer: Any, prompt: str | list[Message]) -> list[int]:
    """Token ids of `prompt` (a user message, or a whole conversation of {"role", "content"}
    messages) laid out by the tokenizer's chat template, ending with the assistant's turn."""
    if tokenizer is None:
        raise ChatError("chat needs a checkpoint with a tokenizer (a checkpoint directory or a "
                        "GGUF file)")
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError("the model's tokenizer has no chat template")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise ChatError("a chat prompt is a string or a non-empty list of {'role': str, "
                        "'content': str} messages")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def model_eos(tokenizer: Any) -> int | None:
    """The token the model ends its turn with (None when the tokenizer names none)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return int(eos) if isinstance(eos, int) else None


def until_eos(tokens: list[int], eos: int | None) -> list[int]:
    """`tokens` up to and including the first `eos`."""
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens

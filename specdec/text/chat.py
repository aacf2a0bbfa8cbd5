"""Chat encoding: a conversation through the target's chat template, to token ids."""

from __future__ import annotations

import re


def encode_messages(tok, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """``messages`` through ``tok``'s chat template, tokenized. Control tokens come from the
    template only: a message whose content spells one (a user writing ``<|im_end|>`` to open a
    system turn of their own) has that content encoded as plain text, as vLLM's and llama.cpp's
    servers do. Contents without such strings take the plain path (the whole rendered text
    tokenized at once), so ordinary prompts tokenize exactly as the template intends."""
    specials = _control_strings(tok)
    if not any(s in (m.get("content") or "") for m in messages for s in specials):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return tok(text, add_special_tokens=False)["input_ids"]
    # Render with a sentinel in place of each content, then tokenize the template's pieces with
    # control tokens parsed and the contents with every control string split into plain text.
    marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
    text = tok.apply_chat_template(marked, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids: list[int] = []
    for n, piece in enumerate(re.split("\ue000(\\d+)\ue001", text)):
        if n % 2 == 0:
            ids += tok(piece, add_special_tokens=False)["input_ids"] if piece else []
        else:
            content = messages[int(piece)].get("content") or ""
            ids += tok(content, add_special_tokens=False, split_special_tokens=True)["input_ids"] if content else []
    return ids


def _control_strings(tok) -> list[str]:
    """The tokenizer's special (control) token strings: never to be parsed from user content."""
    return [t.content for t in tok.added_tokens_decoder.values() if t.special]

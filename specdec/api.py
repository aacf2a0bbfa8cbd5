"""Text in, text out: tokenization, chat templates, stop strings and streaming around the engine.

This is the layer the CLI (and later the server) calls; the engine itself works on token ids.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specdec.detokenize import IncrementalDetokenizer, StopFinder
from specdec.engine import RowResult, generate
from specdec.metrics import GenerationMetrics
from specdec.proposers.head import DraftHead
from specdec.proposers.suffix import SuffixHistory
from specdec.models import heads, loading
from specdec.runtime.linear import DEFAULT_DTYPE
from specdec.sampling import SamplingParams
from specdec.speculation import SpeculationConfig

# A draft model computes logits only for this many frequent ids (FR-Spec; heads.frequent_ids):
# on the 0.5B draft, its output layer shrinks from 151,936 to 65,536 rows (~50 MB fewer bytes per
# draft token) at the same acceptance on code (docs/CHANGELOG.md, 'Fewer ops per layer'). Exact whatever the size:
# the other ids get q = 0 and are never drafted.
DRAFT_VOCAB = 65536

_EOS_STRINGS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<eos>", "</s>", "<|eot_id|>")


class TextStream:
    """One answer's text as its tokens arrive: decoded a few tokens at a time, searched for stop
    strings, and released only up to where a stop string may still begin (the CLI's streaming
    and the server's SSE chunks both come from here)."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.finder = StopFinder(stop)
        self.emitted = 0  # characters already released

    def stop_at(self, ids: list[int]) -> int | None:
        """``ids``: the whole answer so far (one more token than the last call, or more). The
        number of ids to keep if a stop string has appeared in their text, else None."""
        self.detok.update(ids)
        return len(ids) if self.finder.feed(self.detok.text) is not None else None

    def release(self) -> str:
        """The text safe to show that has not been shown yet."""
        text = self.detok.text
        end = self.finder.safe_length(text)
        if end <= self.emitted:
            return ""
        out, self.emitted = text[self.emitted : end], end
        return out

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the whole answer, cut at its stop string) not yet shown."""
        out = final_text[self.emitted :] if len(final_text) > self.emitted else ""
        self.emitted = max(self.emitted, len(final_text))
        return out


@dataclass
class TextResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: GenerationMetrics  # this request's own
    batch_metrics: GenerationMetrics  # the whole batch, with the time breakdown by phase
    prompt_tokens: int = 0
    error: str | None = None  # why the request failed (finish_reason "error")


@dataclass
class TextGenerator:
    """A loaded target (and optional draft) with its tokenizer."""

    target: loading.LoadedModel
    draft: loading.LoadedModel | None = None
    eos_token_ids: set[int] = field(default_factory=set)
    head_path: Path | None = None  # the draft head to use, loaded on first use (see draft_head)
    _head: DraftHead | None = None
    _draft_view: tuple | None = None  # (the draft with its pruned output layer, its ids), built on first use
    # Earlier outputs, shared by the suffix proposers of later calls (what other requests wrote).
    suffix_history: SuffixHistory = field(default_factory=SuffixHistory)

    @classmethod
    def load(cls, target: str, draft: str | None = None, dtype: str = DEFAULT_DTYPE, draft_dtype: str | None = None,
             head: str | Path | None = "auto"):
        """``head``: a draft head file, "auto" (the head shipped for the target, if any) or None;
        it is read only when a proposer uses it."""
        t = loading.load(target, dtype)
        d = loading.load(draft, draft_dtype or dtype) if draft else None
        if d is not None:
            check_compatible(t, d)
        path = heads.shipped(target) if head == "auto" else head  # matched by the GGUF's sha256, not its name
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"no draft head at {path}")
        gen = cls(t, d, head_path=Path(path) if path else None)
        tok = t.tokenizer
        ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        vocab = tok.get_vocab()
        ids |= {vocab[s] for s in _EOS_STRINGS if s in vocab}
        gen.eos_token_ids = ids
        return gen

    def draft_head(self) -> DraftHead:
        if self._head is None:
            if self.head_path is None:
                raise ValueError(f"proposer 'head' needs a draft head: {self.target.name} has none shipped; "
                                 "train one with `specdec train-head` and pass its file (head=PATH)")
            self._head = heads.load_head(self.head_path, self.target)
        return self._head

    def draft_model(self):
        """The draft model as proposers use it: ``(model, ids)``, its output layer restricted to
        :data:`DRAFT_VOCAB` frequent ids (``ids`` None when the vocabulary is no larger)."""
        if self._draft_view is None:
            if self.draft is None:
                raise ValueError("proposer 'draft' needs a draft model (draft=NAME_OR_PATH)")
            model, ids = self.draft.model, None
            if model.vocab_size > DRAFT_VOCAB:
                ids = heads.frequent_ids(self.head_path, model.vocab_size, DRAFT_VOCAB)
                model = model.with_output_rows(heads.output_rows(self.draft, ids))
                loading.release_freed_memory()
            self._draft_view = (model, ids)
        return self._draft_view

    def speculation(self, method: str | None = None, **options) -> SpeculationConfig:
        """The config for ``method`` (None: the default) given what this generator has loaded;
        ``options``: ``k``, ``k_max``, ``ngram``, ``exit_layer`` (None: their defaults). See
        :meth:`SpeculationConfig.resolve`."""
        return SpeculationConfig.resolve(method, draft=self.draft is not None, head=self.head_path is not None,
                                         **options)

    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            return self.encode_chat(messages)
        return self.target.tokenizer(prompt)["input_ids"]

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation in the target's chat template, ready for the assistant's
        turn (the one place chat is encoded: CLI, API, server and head training); see
        :func:`encode_messages`."""
        tok = self.target.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"{self.target.name} has no chat template (chat=False / --chat off / /v1/completions)")
        return encode_messages(tok, messages, add_generation_prompt)

    def final_text(self, ids: list[int], stop: list[str]) -> str:
        """An answer's whole text, cut where its first stop string begins (one full decode)."""
        return _cut_at_stop(self.decode(ids), [s for s in stop if s])

    def decode(self, ids: list[int]) -> str:
        return self.target.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        max_new_tokens: int,
        *,
        speculation: SpeculationConfig | None = None,
        seed: int = 0,
        stop: list[str] | None = None,
        on_text: Callable[[int, str], None] | None = None,
        ignore_eos: bool = False,
    ) -> list[TextResult]:
        """Generate for token-id prompts; exact target sampling whatever speculates.

        ``speculation``: how (:meth:`speculation` builds one; None: the default for what is
        loaded). ``ignore_eos`` (as vLLM's): generate past end-of-sequence tokens, up to
        ``max_new_tokens`` or a stop string (benchmarks measuring a fixed length)."""
        spec = self.speculation() if speculation is None else speculation
        stop = [s for s in (stop or []) if s]
        streams = [TextStream(self.target.tokenizer, stop) for _ in prompts]

        def stop_checker(row: int, ids: list[int]) -> int | None:
            return streams[row].stop_at(ids)

        def on_tokens(row: int, ids: list[int]) -> None:
            if not stop:
                streams[row].detok.update(ids)
            text = streams[row].release()
            if text:
                on_text(row, text)

        capacity = spec.capacity(max(len(p) for p in prompts) + max_new_tokens)
        impl = spec.build(self, capacity)
        rows: list[RowResult] = generate(
            self.target.model,
            prompts,
            params,
            max_new_tokens,
            proposer=impl,
            k=spec.k,
            k_max=spec.k_max,
            seed=seed,
            eos_token_ids=set() if ignore_eos else self.eos_token_ids,
            stop_checker=stop_checker if stop else None,
            on_tokens=on_tokens if on_text else None,
        )
        out = []
        for i, (prompt, row) in enumerate(zip(prompts, rows)):
            text = self.final_text(row.token_ids, stop)
            rest = streams[i].finish(text)  # held-back text of a row that did not stop there
            if on_text and rest:
                on_text(i, rest)
            out.append(TextResult(text, row.token_ids, row.finish_reason, row.metrics, row.batch_metrics, len(prompt),
                                  row.error))
        return out


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


def _cut_at_stop(text: str, stop: list[str]) -> str:
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    return text if cut < 0 else text[:cut]


def check_compatible(target: loading.LoadedModel, draft: loading.LoadedModel) -> None:
    """Draft and target must share the vocabulary: same size and the same token strings."""
    tv, dv = target.model.vocab_size, draft.model.vocab_size
    if tv != dv:
        raise ValueError(f"vocabulary mismatch: target {target.name} has {tv} ids, draft {draft.name} has {dv}")
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        diff = [tok for tok, i in t_vocab.items() if d_vocab.get(tok) != i][:5]
        raise ValueError(
            f"tokenizer mismatch between target {target.name} and draft {draft.name}: "
            f"token strings differ (e.g. {diff}); speculative decoding needs the same tokenizer"
        )

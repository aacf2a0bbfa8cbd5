"""A loaded target (and draft, and head) with its tokenizer: what the CLI, the bench and the
server call. Chat encoding, speculation configs and engines are made here, once; text, stop
strings and streaming are the session's (:mod:`specdec.text.session`); the engine works on token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specdec.cache import notice
from specdec.core.prefix_cache import PrefixCache
from specdec.core.adaptive import CallCosts
from specdec.core.engine import Engine, new_engine
from specdec.core.prefill import STEP_TOKENS
from specdec.core.rows import Request
from specdec.runtime.head import DraftHead
from specdec.proposers.suffix import SuffixHistory
from specdec.models import heads, loading
from specdec.models.costs import calibrate, calibrated, load_costs, save_costs
from specdec.runtime.linear import DEFAULT_DTYPE
from specdec.verify.sampling import SamplingParams
from specdec.text.chat import encode_messages
from specdec.text.session import Session, TextResult
from specdec.speculation import AUTO, SpeculationConfig, auto_draft
from specdec.text.vocab import VocabMap

_EOS_STRINGS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<eos>", "</s>", "<|eot_id|>")


@dataclass
class TextGenerator:
    """A loaded target (and optional draft) with its tokenizer."""

    target: loading.LoadedModel
    draft: loading.LoadedModel | None = None
    eos_token_ids: set[int] = field(default_factory=set)
    draft_text: bool = False  # the draft has another tokenizer: it drafts text (proposers.text_draft)
    head_path: Path | None = None  # the draft head to use, loaded on first use (see draft_head)
    _head: DraftHead | None = None
    vocab_map: VocabMap | None = None  # the draft numbers tokens otherwise than the target (text.vocab)
    _draft_view: heads.DraftView | None = None  # the draft with its pruned output layer, built on first use
    # Earlier outputs, shared by the suffix proposers of later calls (what other requests wrote).
    suffix_history: SuffixHistory = field(default_factory=SuffixHistory)
    # What the target's calls cost by the positions they score, learned by every engine made here
    # and kept for the next process (specdec.models.costs; :meth:`keep_costs`).
    call_costs: CallCosts = field(default_factory=CallCosts)

    @classmethod
    def load(cls, target: str, draft: str | None = None, dtype: str = DEFAULT_DTYPE, draft_dtype: str | None = None,
             head: str | Path | None = "auto", context: int = loading.CONTEXT):
        """``head``: a draft head file, "auto" (the head shipped for the target, if any) or None;
        it is read only when a proposer uses it. ``context``: the tokens of KV cache the memory
        check counts (a model that cannot fit with it is refused before loading)."""
        if draft == AUTO:
            draft = auto_draft(target)
        t = loading.load(target, dtype, context=context)
        d = loading.load(draft, draft_dtype or dtype, role="draft", context=context) if draft else None
        vocab = None if d is None or same_tokenizer(t, d) else draft_vocabulary(t, d)
        text = vocab is not None and not vocab.usable
        if text:
            vocab = None
        path = heads.shipped(target) if head == "auto" else head  # matched by the GGUF's sha256, not its name
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"no draft head at {path}")
        gen = cls(t, d, head_path=Path(path) if path else None, draft_text=text, vocab_map=vocab,
                  call_costs=load_costs(t))
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
        """The draft model as proposers use it (a :class:`specdec.models.heads.DraftView`): its
        output layer restricted to :data:`specdec.models.heads.DRAFT_VOCAB` frequent ids (``ids``
        None when the vocabulary is no larger), through :attr:`vocab_map` where the draft numbers
        tokens otherwise; see :func:`specdec.models.heads.pruned_draft`."""
        if self._draft_view is None:
            if self.draft is None:
                raise ValueError("proposer 'draft' needs a draft model (draft=NAME_OR_PATH)")
            self._draft_view = heads.pruned_draft(self.draft, self.head_path, self.vocab_map)
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
        :func:`specdec.text.chat.encode_messages`."""
        tok = self.target.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"{self.target.name} has no chat template (chat=False / --chat off / /v1/completions)")
        return encode_messages(tok, messages, add_generation_prompt)

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
        if not prompts:
            return []
        # prompts prefilled in chunks of the server's step budget: the same bits as one call, a
        # long prompt's intermediates a chunk's size (a 3,950-token prompt at 8B: ~1 GB otherwise),
        # and faster (2,000 tokens at 1.5B: 6.3 s against 7.3 s in one call, Zen 5)
        engine = self.engine(spec, max(len(p) for p in prompts) + max_new_tokens, seed=seed, ignore_eos=ignore_eos,
                             token_budget=STEP_TOKENS)
        requests = [Request(p, params, max_new_tokens) for p in prompts]
        results = Session(engine, self.target.tokenizer).run(requests, stop, on_text)
        self.keep_costs()
        return results

    def keep_costs(self) -> None:
        """Keep the target's call costs learned so far for the next process to start from."""
        save_costs(self.target, self.call_costs)

    def engine(self, spec: SpeculationConfig, tokens: int, *, seed: int = 0, max_batch: int | None = None,
               ignore_eos: bool = False, prefix_cache: PrefixCache | None = None,
               token_budget: int | None = None) -> Engine:
        """An engine over the target with ``spec``'s proposer, each row holding up to ``tokens``
        (prompt + max_new_tokens), made by :func:`~specdec.core.engine.new_engine` (for the API,
        bench and server). ``prefix_cache``: KV of earlier prompts and answers to reuse (the target's own); ``token_budget``: positions a step computes (chunked prefill, :class:`Engine`)."""
        if spec.k == "auto" and not calibrated(self.call_costs):
            calibrate(self.target.model, self.call_costs)  # once per model and machine: kept with the rest
            self.keep_costs()
        return new_engine(self.target.model, tokens, lambda capacity: spec.build(self, capacity), k=spec.k,
                          k_max=spec.k_max, eos_token_ids=set() if ignore_eos else self.eos_token_ids, seed=seed,
                          max_batch=max_batch, prefix_cache=prefix_cache, token_budget=token_budget,
                          call_costs=self.call_costs)


def draft_vocabulary(target: loading.LoadedModel, draft: loading.LoadedModel) -> VocabMap:
    """The map between a draft's and a target's vocabularies, said on stderr: the draft drafts
    the shared tokens (:mod:`specdec.text.vocab`), or, where they share too few, text."""
    vocab = VocabMap.build(target.tokenizer, draft.tokenizer, target.model.vocab_size, draft.model.vocab_size)
    if vocab.usable:
        notice(f"{draft.name}'s vocabulary ({draft.model.vocab_size} ids) differs from {target.name}'s "
               f"({target.model.vocab_size}): it drafts the {len(vocab.target_ids)} tokens both have, matched by "
               "string (exact: q is zero outside them)")
    else:
        notice(f"{draft.name} has another tokenizer than {target.name} ({vocab.shared:.0%} of its tokens shared): "
               "it drafts text, which the target's tokenizer turns into deterministic drafts (exact: one-hot q)")
    return vocab


def same_tokenizer(target: loading.LoadedModel, draft: loading.LoadedModel) -> bool:
    """Whether draft and target share the vocabulary: the same size and every token string with
    the same id (then the draft drafts target tokens; otherwise it drafts text)."""
    if target.model.vocab_size != draft.model.vocab_size:
        return False
    return target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()

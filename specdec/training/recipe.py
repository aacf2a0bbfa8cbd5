"""What ``specdec train-head`` runs, as one validated object: :class:`HeadRecipe`.

The command line builds a recipe and hands it on; the stages of :mod:`specdec.training.run` read
it and decide nothing again. Every rule about which options go together lives in
:meth:`HeadRecipe.problems`, and :meth:`HeadRecipe.command` writes the command that reproduces a
recipe (what a head's card records). Errors name the ``train-head`` options, which are the
recipe's fields with dashes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

from specdec.training.train import TrainConfig

SOURCES = ("sharegpt", "python-docs")  # the corpora train-head reads, and whose requests the target answers
# Requests the target answers itself: the corpora's, and requests to translate ShareGPT's English
# paragraphs (sharegpt.translation_prompts), for the non-English text the corpus lacks.
ANSWER_SOURCES = SOURCES + ("sharegpt-translate",)


@dataclass(frozen=True)
class AnswerSlice:
    """Batches ``first`` .. ``end - 1`` of the target's own answers to ``source``'s requests
    (batch b answers requests 16 b .. 16 b + 15 of :func:`~specdec.training.run.answer_prompts`,
    so a batch is the same text whichever slice names it): stage 2's data, e.g.
    ``sharegpt:36-63`` for batches no earlier stage trained on, mixed with ``python-docs:0-16``."""

    source: str
    first: int
    end: int

    def __post_init__(self):
        if self.source not in ANSWER_SOURCES:
            raise ValueError(f"AnswerSlice.source must be one of {ANSWER_SOURCES}, got {self.source!r}")
        if not 0 <= self.first < self.end:
            raise ValueError(f"AnswerSlice needs 0 <= first < end, got {self.first}-{self.end}")

    @classmethod
    def parse(cls, text: str) -> "AnswerSlice":
        """``SOURCE:FIRST-END`` or ``SOURCE:N`` (batches 0 .. N - 1)."""
        match = re.fullmatch(r"([\w-]+):(?:(\d+)-)?(\d+)", text)
        if match is None:
            raise ValueError(f"an answer slice is SOURCE:FIRST-END or SOURCE:N, got {text!r}")
        source, first, end = match.groups()
        return cls(source, int(first or 0), int(end))

    @property
    def batches(self) -> range:
        return range(self.first, self.end)

    def __str__(self) -> str:
        return f"{self.source}:{self.first}-{self.end}"


@dataclass(frozen=True)
class HeadRecipe:
    """One run of ``train-head``: the corpus (``source``, ``seq_len`` tokens per sequence, a
    corpus of ``tokens``, the first ``sequences`` of it, python-docs files under ``corpus_root``),
    the training settings (``train``), stage 2 (the target's own ``answers`` and
    ``finetune_steps``), where it starts (``init_head``: a head made earlier for the same target),
    whether stage 2 re-chooses (``new_vocab``) or widens (``widen_vocab``) the drafted ids, and
    ``extract_only`` (stop once the features, or with ``answers`` the own answers, are written).

    The modes: no ``init_head``: stage 1 (corpus), then stage 2 when ``answers`` are given; an
    ``init_head`` with ``answers``: stage 2 from it; an ``init_head`` alone: further training on
    the corpus, evaluated before and after on held-out conversations."""

    source: str = "sharegpt"
    seq_len: int = 0  # 0: 1024 for sharegpt, 512 for python-docs
    tokens: int = 480_000
    sequences: int | None = None
    corpus_root: Path | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    answers: tuple[AnswerSlice, ...] = ()
    finetune_steps: int = 0
    init_head: Path | None = None
    new_vocab: bool = False
    widen_vocab: int = 0
    extract_only: bool = False

    def __post_init__(self) -> None:
        if not self.seq_len:
            object.__setattr__(self, "seq_len", 1024 if self.source == "sharegpt" else 512)
        object.__setattr__(self, "answers", tuple(self.answers))
        for problem in self.problems():
            raise ValueError(problem)

    @property
    def stage2(self) -> bool:
        """Whether this run trains on the target's own answers."""
        return bool(self.answers and self.finetune_steps)

    def problems(self) -> Iterator[str]:
        """What is wrong with this recipe, one line each (the first is raised on construction)."""
        t = self.train
        if self.source not in SOURCES:
            yield f"--corpus must be one of {', '.join(SOURCES)}, got {self.source!r}"
        if self.corpus_root is not None and not Path(self.corpus_root).is_dir():
            yield f"--corpus-root {self.corpus_root} is not a directory"
        if (self.source == "sharegpt" and self.corpus_root is not None
                and not any(a.source == "python-docs" for a in self.answers)):
            yield ("--corpus-root reads python-docs; it does not apply to --corpus sharegpt "
                   "(only to python-docs answers named by --answers)")
        if t.vocab_size % 8 or t.intermediate_size % 32:
            yield "--vocab-size must be a multiple of 8 and --intermediate-size a multiple of 32"
        if not 0 < t.lr <= 1:
            yield f"--lr must be in (0, 1], got {t.lr}"
        if t.answers_only and not t.label_top_k:
            yield "--answers-only needs --label-top-k"
        if not 0 < t.chain_share <= 1:
            yield f"--chain-share must be in (0, 1], got {t.chain_share}"
        elif t.chain_share != 1 and not t.label_top_k:
            yield "--chain-share needs --label-top-k"
        yield from self._stage_problems()

    def _stage_problems(self) -> Iterator[str]:
        if bool(self.answers) != bool(self.finetune_steps) and not self.extract_only:
            yield "--answer-batches (or --answers) and --finetune-steps go together (stage 2 needs both)"
        if self.new_vocab and not self.answers:
            yield "--new-vocab applies to stage 2: it needs --answer-batches (or --answers) and --finetune-steps"
        if self.widen_vocab and (not self.answers or self.init_head is None or self.new_vocab or self.widen_vocab % 8):
            yield ("--widen-vocab applies to stage 2 from --init-head (with --answers and --finetune-steps), "
                   "not with --new-vocab, and must be a multiple of 8")
        if self.init_head is not None and not Path(self.init_head).is_file():
            yield f"--init-head {self.init_head} is not a file"

    def with_train(self, **changes) -> "HeadRecipe":
        """This recipe with some training settings changed (validated again)."""
        return replace(self, train=replace(self.train, **changes))

    def command(self, target: str, dtype: str, out: str) -> str:
        """The ``train-head`` command that runs this recipe (``--corpus-root`` left out: a path of
        the machine it ran on), as a head's card records it."""
        t = self.train
        parts = [f"specdec train-head --target {target} --dtype {dtype} --corpus {self.source} --seq-len {self.seq_len}",
                 f"--tokens {self.tokens}" + (f" --sequences {self.sequences}" if self.sequences else ""),
                 f"--steps {t.steps} --batch {t.batch_sequences} --lr {t.lr} --vocab-size {t.vocab_size}",
                 f"--intermediate-size {t.intermediate_size} --passes {t.passes} --seed {t.seed}"]
        parts += [f"--init-head {Path(self.init_head).name}"] if self.init_head is not None else []
        parts += [f"--label-top-k {t.label_top_k}"] if t.label_top_k else []
        parts += ["--answers-only"] if t.answers_only else []
        parts += [f"--chain-share {t.chain_share:g}"] if t.chain_share != 1 else []
        if self.answers:
            parts += ["--answers " + " ".join(map(str, self.answers)), f"--finetune-steps {self.finetune_steps}"]
        parts += ["--new-vocab"] if self.new_vocab else []
        parts += [f"--widen-vocab {self.widen_vocab}"] if self.widen_vocab else []
        return " ".join(parts + [f"--out {out}"])

"""The draft head's training text: real text already on this machine, formatted as the target sees it.

Source: the Python sources and package descriptions installed with specdec's own dependencies
(site-packages), which no bench or test workload comes from. Each item is a chunk of one file
(code in a fenced block, or prose), wrapped as a chat turn — a user instruction then the chunk as
the assistant's answer — through the target's own chat template, and cut at ``seq_len`` tokens.
The item list is sorted and shuffled with a fixed seed, so the same installed packages give the
same corpus; the manifest records every file and package version used.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from specdec.training.features import SHARD

PROSE_EVERY = 4
CHUNK_CHARS = 1600  # ~400-500 tokens of code: one item fills most of a 512-token sequence
# Installed packages that are models or our own code, not text to learn from.
_SKIP = ("specdec", "gguf", "smollm2", "qwen", "gemma", "__pycache__", "_distutils_hack")


@dataclass
class Item:
    source: str  # file path relative to site-packages
    kind: str  # "code" or "prose"
    part: int
    text: str


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _chunks(text: str, limit: int = CHUNK_CHARS) -> list[str]:
    """Split at line boundaries into pieces of at most ~``limit`` characters (never empty)."""
    out, cur, size = [], [], 0
    for line in text.splitlines(keepends=True):
        if size + len(line) > limit and cur:
            out.append("".join(cur))
            cur, size = [], 0
        cur.append(line[: limit * 2])
        size += len(line)
    if cur:
        out.append("".join(cur))
    return [c for c in out if c.strip()]


def collect(root: Path | None = None) -> list[Item]:
    """Every code and prose chunk under ``root`` (default: this interpreter's site-packages)."""
    root = root or site_packages()
    items: list[Item] = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or any(s in rel.split("/")[0].lower() for s in _SKIP):
            continue
        if path.suffix == ".py" and 1_000 <= path.stat().st_size <= 200_000:
            kind = "code"
        elif path.name == "METADATA" or (path.suffix in (".md", ".rst") and path.stat().st_size >= 2_000):
            kind = "prose"
        else:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if path.name == "METADATA":  # keep the long description, not the headers
            text = text.partition("\n\n")[2]
        items += [Item(rel, kind, i, chunk) for i, chunk in enumerate(_chunks(text))]
    return items


def _messages(item: Item) -> list[dict]:
    name = item.source.removesuffix(".py").replace("/", ".")
    if item.kind == "code":
        ask = f"Write part {item.part + 1} of the Python module `{name}`."
        answer = f"```python\n{item.text.rstrip()}\n```"
    else:
        package = item.source.split("/")[0].split("-")[0]
        ask = f"Explain part {item.part + 1} of the documentation of {package}."
        answer = item.text.strip()
    return [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]


def build(tokenizer, max_tokens: int, seq_len: int = 512, seed: int = 0, root: Path | None = None) -> dict:
    """Token sequences totalling about ``max_tokens``: ``{"sequences": [[ids]], "manifest": ...}``."""
    items = collect(root)
    if not items:
        raise ValueError(f"no Python sources or documentation found under {root or site_packages()}")
    rng = random.Random(seed)
    code = [i for i in items if i.kind == "code"]
    prose = [i for i in items if i.kind == "prose"]
    rng.shuffle(code)
    rng.shuffle(prose)
    # Prose is scarce (~1% of the chunks): every PROSE_EVERY-th item is prose while it lasts.
    items = []
    while code or prose:
        if prose and (len(items) % PROSE_EVERY == 0 or not code):
            items.append(prose.pop())
        elif code:
            items.append(code.pop())
    sequences, sources, total = [], [], 0
    for item in items:
        if total >= max_tokens:
            break
        text = tokenizer.apply_chat_template(_messages(item), tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:seq_len]
        if len(ids) < 32:
            continue
        sequences.append(ids)
        sources.append(f"{item.source}#{item.part}")
        total += len(ids)
    # Whole shards only, so that a larger corpus built later extends this one shard by shard.
    keep = max(1, len(sequences) // SHARD) * SHARD
    sequences, sources = sequences[:keep], sources[:keep]
    total = sum(len(s) for s in sequences)
    packages = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"]})
    manifest = {"seed": seed, "seq_len": seq_len, "tokens": total, "sequences": len(sequences),
                "items_available": len(items), "sources": sources, "packages": packages}
    return {"sequences": sequences, "manifest": manifest}


def save(corpus: dict, path: Path) -> None:
    path.write_text(json.dumps(corpus))


def load(path: Path) -> dict:
    return json.loads(path.read_text())


LANGUAGES = ("French", "German", "Spanish", "Italian")


def answer_prompts(used_sources: set[str], count: int, seed: int = 1, root: Path | None = None) -> list[list[dict]]:
    """Conversations (chat messages ending with a user turn) derived from corpus chunks the
    training text did not use, for the target to answer itself: its own answers are the text a head
    drafts at inference, so the instructions span the kinds of request a user sends — write,
    explain, rewrite or test code, summarise, translate, answer a question about a text, a
    follow-up turn, and small arithmetic word problems (numbers drawn from ``seed``)."""
    import re

    items = [i for i in collect(root) if i.source not in used_sources]
    rng = random.Random(seed)
    rng.shuffle(items)
    prompts: list[list[dict]] = []
    for n, item in enumerate(items):
        kind = n % 8  # chunk n is offered to one kind of request; a chunk that does not fit it is skipped
        text = item.text.strip()
        lines = text.splitlines()
        snippet = "```python\n" + "\n".join(lines[:20]) + "\n```" if item.kind == "code" else text[:1200]
        doc = re.search(r'(?:"""|\'\'\')\s*([A-Z][^\n]{20,200}[.!?])', text) if item.kind == "code" else None
        prose = re.findall(r"^\s*(?:#\s*|\"\"\"|\'\'\')?\s*([A-Z][a-z]+ [a-z][^\n]{20,200}[.])\s*$", text, re.M)
        sentence = " ".join(prose[:2]) if prose else None  # one or two English sentences of the chunk
        func = re.search(r"def (\w+)\(([^)]*)\)[^:]*:", text)
        if kind == 0 and item.kind == "code" and func and doc:
            ask = f"Write a Python function `{func.group(1)}({func.group(2)[:60]})`: {doc.group(1)}"
        elif kind == 1:
            ask = ("Explain what this Python code does:\n\n" if item.kind == "code"
                   else "Summarize this documentation in a few sentences:\n\n") + snippet
        elif kind == 2 and item.kind == "code":
            ask = "Rewrite this code to be clearer, with comments:\n\n" + snippet
        elif kind == 3 and item.kind == "code":
            ask = "Write unit tests with pytest for this code:\n\n" + snippet
        elif kind == 4 and sentence and len(sentence) > 30:
            ask = f"Translate into {LANGUAGES[len(prompts) // 8 % len(LANGUAGES)]}: {sentence}"
        elif kind == 5:
            subject = f"the function `{func.group(1)}`" if func else "this text"
            ask = f"{snippet}\n\nAnswer briefly: what is the purpose of {subject}, and when would you use it?"
        elif kind == 6 and func and doc:
            prompts.append([{"role": "user", "content": f"What does `{func.group(1)}` do?\n\n{snippet}"},
                            {"role": "assistant", "content": doc.group(1)},
                            {"role": "user", "content": "Show a short example of calling it, and explain the result."}])
            continue
        elif kind == 7:
            ask = _word_problem(rng)
        else:
            continue
        prompts.append([{"role": "user", "content": ask}])
        if len(prompts) >= count:
            break
    return prompts[:count]


def _word_problem(rng: random.Random) -> str:
    """A small arithmetic word problem with random numbers, to be solved step by step."""
    a, b, c = rng.randint(3, 60), rng.randint(2, 25), rng.randint(2, 9)
    return rng.choice([
        f"A shop sells notebooks at ${b} each. Ana buys {a} notebooks and pays with ${a * b + c * 10}. How much change does she get? Solve step by step.",
        f"A train travels {a * c} km in {c} hours. At the same speed, how far does it go in {c + b % 5 + 1} hours? Show your reasoning.",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter? Explain each step.",
        f"There are {a} students in a class; {b % a or 1} of them are absent. What percentage is present? Round to one decimal and explain.",
        f"Solve for x: {c}x + {a} = {c * b + a}. Show each step.",
        f"What is the sum of the integers from 1 to {a + b}? Explain the method you use.",
    ])

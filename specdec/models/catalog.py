"""The models on this machine, for finding a draft: their tokenizer fingerprints and sizes.

A draft model can draft for a target when both map every token string to the same id and share
their special tokens: :func:`tokenizer_fingerprint` hashes exactly that (the token -> id map with
added tokens, and each special token with its id), so two models match when their fingerprints
are equal. A fine-tune with other special tokens shares nearly all of its strings with the base
family's models instead: :func:`shared_fraction` measures that. Fingerprints are cached per directory content (``$SPECDEC_HOME/fingerprints``): loading
a 150k-token tokenizer takes ~1 s, reading the cache a millisecond.

The choice of a draft is not made here but in :func:`specdec.speculation.auto_draft`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from specdec import cache
from specdec.models import loading, registry


@dataclass(frozen=True)
class Installed:
    """A model ready to load: its name (registry name or directory), directory and size."""

    name: str
    directory: Path
    parameters: int


def tokenizer_fingerprint(directory: Path) -> str:
    """16 hex digits over the tokenizer's token -> id map and its special tokens with their ids."""
    key = loading.content_key(directory, "tokenizer-fingerprint-v1")
    stored = registry.home() / "fingerprints" / f"{key}.json"
    try:
        return json.loads(stored.read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    special = sorted((t, tok.convert_tokens_to_ids(t)) for t in tok.all_special_tokens)
    digest = hashlib.sha256(json.dumps([sorted(tok.get_vocab().items()), special]).encode()).hexdigest()[:16]
    stored.parent.mkdir(parents=True, exist_ok=True)
    cache.write_atomic(stored, lambda tmp: tmp.write_text(json.dumps({"fingerprint": digest, "directory": str(directory)})))
    return digest


def shared_fraction(target: Path, draft: Path) -> float:
    """The fraction of the target tokenizer's strings that the draft's also has (for drafting
    through their intersection, :mod:`specdec.text.vocab`), cached per pair of directory contents."""
    key = loading.content_key(target, "shared-v1") + "-" + loading.content_key(draft, "shared-v1")
    stored = registry.home() / "fingerprints" / f"shared-{key}.json"
    try:
        return float(json.loads(stored.read_text())["shared"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from transformers import AutoTokenizer

    mine, theirs = (AutoTokenizer.from_pretrained(str(d), local_files_only=True).get_vocab() for d in (target, draft))
    shared = sum(1 for s in mine if s in theirs) / max(1, len(mine))
    stored.parent.mkdir(parents=True, exist_ok=True)
    cache.write_atomic(stored, lambda tmp: tmp.write_text(json.dumps({"shared": shared, "target": str(target),
                                                                      "draft": str(draft)})))
    return shared


def parameters(directory: Path) -> int:
    """The number of weights of a model: a GGUF file's (from its metadata directory's marker), or
    a Hugging Face directory's safetensors files (read from their headers)."""
    from safetensors import safe_open

    try:
        return int(json.loads((directory / loading.DONE).read_text())["parameters"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    total = 0
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                count = 1
                for n in handle.get_slice(key).get_shape():
                    count *= n
                total += count
    return total


def installed() -> list[Installed]:
    """Every model ready to load: the registry's assembled files (by name) and the GGUF files
    specdec has loaded before (by path, while the file is still there; an entry naming a directory
    is that directory), each with its metadata
    directory (config and tokenizer)."""
    found, seen = [], set()
    for spec in registry.MODELS.values():
        if spec.installed():
            meta = loading.metadata_for(spec.name)
            found.append(Installed(spec.name, meta, parameters(meta)))
            seen.add(meta.resolve())
    root = registry.home() / "models"
    for directory in sorted(root.iterdir()) if root.is_dir() else ():
        if directory.resolve() in seen or not loading.is_converted(directory):
            continue
        source = Path(json.loads((directory / loading.DONE).read_text())["source"])
        if source.exists():
            found.append(Installed(str(source), directory, parameters(directory)))
    return found

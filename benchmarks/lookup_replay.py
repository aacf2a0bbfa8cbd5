"""Replay a bench's greedy answers through the hybrids' lookup side: where it matches, and how well
it drafts there against the head alone (issue 29, item 8: re-tune the hybrid on the new head).

At temperature 0 a chain draft is accepted exactly as far as it equals the target's greedy
continuation, and the plain runs of a bench are that continuation. So the lookup side (the suffix
proposer drafting chains, :func:`specdec.speculation.copy_lookup`'s settings) can be scored without
the model: at every position of every plain greedy answer, it is fed the text so far (the prompt
in the target's chat template, then the answer), and where it has a match its ``--k``-token chain
is compared with what follows. Reported per category, by the length of the longest context suffix
that occurred before (the n-gram lookup's match, ``NGRAM``'s range; 0: the proposer drafts from a
copy it is following, with no fresh match): positions, the share whose first draft is right, and
the mean number of drafts accepted. Beside it, the head alone's expected accepted drafts per call,
``sum_i prod_{j<=i} a_j`` from its pooled per-position acceptance in the same runs (method
``head``, fixed k), over all positions of the category.

Approximations: every position is scored (the engine drafts only where a step starts); each
prompt starts with an empty shared history (the bench's later prompts also see earlier answers);
the head's figure is its average over the category, not at the positions the lookup matched.

    .venv/bin/python benchmarks/lookup_replay.py --runs docs/head-eval/bench8-speed-mix13-zen4.runs.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

from specdec.adaptive import expected_tokens
from specdec.api import encode_messages
from specdec.bench.jobs import load_workloads
from specdec.models import registry
from specdec.models.loading import converted_dir_for, is_converted
from specdec.proposers.suffix import SuffixProposer
from specdec.sampling import SamplingParams
from specdec.speculation import NGRAM


def match_length(text: list[int], lo: int, hi: int) -> int:
    """The longest suffix of ``text`` (``lo``..``hi`` tokens) that also occurs earlier in it; 0 if none."""
    for n in range(min(hi, len(text) - 1), lo - 1, -1):
        suffix = text[-n:]
        if any(text[s:s + n] == suffix for s in range(len(text) - n - 1, -1, -1)):
            return n
    return 0


def head_expected_accepted(runs: list[dict], category: str, temperature: float) -> float | None:
    """``sum_i prod_{j<=i} a_j`` from the head's pooled per-position acceptance in ``category``."""
    accepted, reached = collections.Counter(), collections.Counter()
    for r in runs:
        if r["method"] == "head" and r["category"] == category and r["temperature"] == temperature:
            acc = r["metrics"]["acceptance"]
            for i, (a, n) in enumerate(zip(acc["accepted_per_position"], acc["reached_per_position"])):
                accepted[i] += a
                reached[i] += n
    if not reached:
        return None
    accept = [accepted[i] / reached[i] if reached[i] else 0.0 for i in range(max(reached) + 1)]
    return expected_tokens(accept, len(accept)) - 1.0  # E(k) counts the token every step commits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, required=True, help="a bench's runs.jsonl with plain greedy runs")
    ap.add_argument("--k", type=int, default=4, help="drafts per lookup chain (default: %(default)s)")
    ap.add_argument("--target", default=registry.DEFAULT_TARGET, help="whose chat template encodes the prompts")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    spec = registry.resolve(args.target)
    if spec is None or not is_converted(converted_dir_for(spec)):
        ap.error(f"{args.target}: not a registry model converted on this machine (run `specdec generate` with it once)")
    tok = AutoTokenizer.from_pretrained(str(converted_dir_for(spec)), local_files_only=True)
    workloads = load_workloads()
    runs = [json.loads(line) for line in args.runs.read_text().splitlines() if line.strip()]
    plain = [r for r in runs if r["method"] == "plain" and r["temperature"] == 0.0]
    if not plain:
        ap.error(f"{args.runs} has no plain greedy runs")
    by_len: dict[str, dict[int, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0, 0]))
    positions = collections.Counter()
    for r in plain:
        prompt = workloads[r["category"]]["prompts"][r["prompt"]]
        prompt_ids = encode_messages(tok, prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}], True)
        answer = r["token_ids"]
        lookup = SuffixProposer(min_match=NGRAM[0], max_match=NGRAM[1], tree_mode="chains")
        lookup.add([prompt_ids], [SamplingParams(temperature=0.0)], torch.Generator())
        for t in range(len(answer)):
            lookup.feed([answer[t - 1:t]])  # the token committed last (none before the first)
            if not lookup.has_match()[0]:
                continue
            drafts = [x for x in lookup.lookup(args.k, tree=False).tokens[0].tolist() if x >= 0]
            accepted = 0
            while accepted < len(drafts) and t + accepted < len(answer) and drafts[accepted] == answer[t + accepted]:
                accepted += 1
            cell = by_len[r["category"]][match_length(prompt_ids + answer[:t], *NGRAM)]
            cell[0] += 1
            cell[1] += accepted > 0
            cell[2] += accepted
        positions[r["category"]] += len(answer)
    print(f"lookup side (suffix chains, NGRAM {NGRAM}, k = {args.k}) on {len(plain)} plain greedy answers of {args.runs}")
    print("| category | positions | lookup matches | by match length n: positions, first right, mean accepted | head alone: mean accepted |")
    print("|---|---|---|---|---|")
    for category in positions:
        cells = by_len[category]
        matched = sum(c[0] for c in cells.values())
        detail = "; ".join(f"n={n}: {c[0]}, {c[1] / c[0]:.2f}, {c[2] / c[0]:.2f}" for n, c in sorted(cells.items()))
        head = head_expected_accepted(runs, category, 0.0)
        print(f"| {category} | {positions[category]} | {matched} ({matched / positions[category]:.2f}) | {detail} | "
              f"{'-' if head is None else f'{head:.2f}'} |")


if __name__ == "__main__":
    main()

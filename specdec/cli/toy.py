"""`specdec toy`: the seed experiment."""

from __future__ import annotations

import argparse
import json
import platform

import torch


def add(sub: argparse._SubParsersAction) -> None:
    from specdec.toy import experiment as ex

    p = sub.add_parser(
        "toy",
        help="run the seed experiment: exact speculative sampling on a 4-token Markov pair",
        description=(
            "Plain target sampling vs exact speculative sampling on the seed's vocab-4 first-order "
            "Markov target/draft pair. With no options it reproduces the seed's printed figures "
            "digit for digit; the closed-form expected rates are printed next to the empirical ones."
        ),
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of key=value lines")
    p.add_argument("--fast", action="store_true", help="simulate many streams at once with batched verify_chain")
    p.add_argument("--tokens", type=int, default=ex.SEED_TOKENS, help="tokens per method (default: %(default)s)")
    p.add_argument("--k", type=int, default=ex.SEED_K, help="draft tokens per call (default: %(default)s)")
    p.add_argument("--streams", type=int, default=2000, help="--fast only: parallel streams (default: %(default)s)")
    p.add_argument("--baseline-seed", type=int, default=ex.SEED_BASELINE)
    p.add_argument("--speculative-seed", type=int, default=ex.SEED_SPECULATIVE)
    p.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
    from specdec.toy import run_fast, run_reference

    if args.tokens <= 0:
        raise SystemExit("specdec toy: --tokens must be positive")
    if args.k < 0:
        raise SystemExit("specdec toy: --k must be >= 0")
    common = dict(tokens=args.tokens, k=args.k, baseline_seed=args.baseline_seed, speculative_seed=args.speculative_seed)
    result = run_fast(streams=args.streams, **common) if args.fast else run_reference(**common)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print(f"python={platform.python_version()} torch={torch.__version__} device=cpu dtype={torch.float64}")
    print(f"tokens={result.tokens} vocab={result.vocab} proposal_len={result.proposal_len}")
    print(f"baseline_vs_target_max_error={result.baseline_vs_target_max_error:.5f}")
    print(f"speculative_vs_target_max_error={result.speculative_vs_target_max_error:.5f}")
    print(f"baseline_vs_speculative_max_error={result.baseline_vs_speculative_max_error:.5f}")
    print(f"mean_accepted_draft_tokens_per_call={result.mean_accepted_draft_tokens_per_call:.3f}")
    print(f"target_calls_per_emitted_token={result.target_calls_per_emitted_token:.3f}")
    print(f"closed_form_accepted_draft_tokens_per_call={result.expected_accepted_draft_tokens_per_call:.3f}")
    print(f"closed_form_target_calls_per_emitted_token={result.expected_target_calls_per_emitted_token:.3f}")
    if result.accepted_per_call_stderr is not None:
        print(f"mode=fast streams={result.streams} accepted_per_call_stderr={result.accepted_per_call_stderr:.4f}")
    print(f"seconds={result.seconds:.3f}")
    return 0

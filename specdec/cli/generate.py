"""`specdec generate`: text from a prompt, speculative by default, streamed or as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from specdec.cli.common import (UsageError, add_model_options, int_at_least, read_prompts, speculation_of,
                                 with_default_draft)
from specdec.verify.sampling import MAX_TEMPERATURE


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with exact speculative decoding (on by default; --proposer none: plain)",
        description="Generate a continuation of --prompt with the target model. A proposer suggests "
        "k tokens per step and the target verifies them in one call; the output distribution is "
        "exactly the target's (at temperature 0: the same tokens as plain decoding). By default the "
        "target's shipped draft head speculates (with lookup of the text's own repeats when it copies, "
        "k chosen each step); with --draft a smaller model does (also with that lookup); --proposer none "
        "decodes plainly.",
    )
    add_model_options(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch; '-' reads stdin")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=128, help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help=f"0 = greedy (default); at most {MAX_TEMPERATURE:g}")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (default: off)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the text")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, metrics)")
    p.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
    from specdec.api import TextGenerator
    from specdec.verify.sampling import SamplingParams

    spec = speculation_of(args)
    if args.system is not None and not args.chat:
        raise UsageError("--system has no effect without --chat")
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
    texts = read_prompts(args.prompt)
    spec = with_default_draft(args, spec)
    gen = TextGenerator.load(args.target, args.draft, args.dtype, args.draft_dtype, head=args.head or "auto")
    print(f"specdec: {spec.describe()}", file=sys.stderr)
    prompts = [gen.encode(t, args.chat, args.system) for t in texts]
    stream = _print_text if not args.json and len(prompts) == 1 else None
    results = gen.generate(prompts, params, args.max_new_tokens, speculation=spec, seed=args.seed,
                           stop=args.stop, on_text=stream)
    failed = [(i, r.error) for i, r in enumerate(results) if r.finish_reason == "error"]
    for i, error in failed:
        print(f"specdec generate: error: prompt {i}: {error}", file=sys.stderr)
    if args.json:
        def one(r):
            # request_metrics: this request's own acceptance, target calls, TTFT and throughput; phase
            # times are measured per step for the whole batch, so they are in "metrics" only.
            own = {key: value for key, value in r.metrics.to_dict().items() if key != "time_breakdown_s"}
            return {"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                    "prompt_tokens": r.prompt_tokens, "request_metrics": own}
        out = one(results[0]) if len(results) == 1 else {"choices": [one(r) for r in results]}
        out["metrics"] = results[0].batch_metrics.to_dict()
        out["config"] = {"target": gen.target.name, "draft": gen.draft.name if gen.draft else None,
                         "proposer": spec.method if spec.speculates else None, "k": spec.k, "dtype": gen.target.model.dtype_name,
                         "temperature": args.temperature,
                         "seed": args.seed,
                         "precision": {"target": gen.target.precision,
                                       "draft": gen.draft.precision if gen.draft else None}}
        print(json.dumps(out))
        return 1 if failed else 0
    if stream is None:
        for i, r in enumerate(results):
            print(f"--- [{i}] ---\n{r.text}")
    else:
        print()
    print(_summary(results[0].batch_metrics.to_dict(), gen, gen.target.model.dtype_name, spec), file=sys.stderr)
    return 1 if failed else 0

def _print_text(row: int, text: str) -> None:
    """Streams a single prompt's text to stdout as it is committed."""
    print(text, end="", flush=True)

def _summary(m: dict, gen, dtype: str, spec) -> str:
    acc = m["acceptance"]
    how = " | plain decoding"
    if spec.speculates:
        model = gen.draft.name if spec.uses_draft else f"draft head {gen.head_path.name}" if spec.uses_head else None
        how = f" | proposer {spec.method}" + (f" ({model})" if model else "") + f" k={spec.k}"
    lines = [
        "",
        f"target {gen.target.name}{how} | {dtype}",
        f"  tokens {m['generated_tokens']:>6}   throughput {m['throughput_tok_s']:7.2f} tok/s   TTFT {m['ttft_s'] * 1e3:8.1f} ms   TPOT {m['tpot_s'] * 1e3:7.1f} ms",
        f"  target calls/token {m['target_calls_per_token']:.3f}   tokens/call {m['tokens_per_call']:.2f}",
    ]
    if spec.speculates:
        lines.append(
            f"  accepted/call {acc['mean_accepted_per_call']:.2f}   acceptance {acc['acceptance_rate']:.1%}   "
            f"full accepts {acc['full_acceptance_rate']:.1%}   per position "
            + " ".join(f"{a:.2f}" for a in acc["acceptance_per_position"])
        )
    b = m["time_breakdown_s"]
    lines.append("  time (s): " + "  ".join(f"{k} {v:.2f}" for k, v in b.items()))
    return "\n".join(lines)

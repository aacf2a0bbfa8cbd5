"""Held-out acceptance of a draft head on ShareGPT conversations it never saw (issue 29's figure).

Three held-out sets (``--sets``), all from conversations split off by id (2%; never trained on):
  sharegpt     the conversations as written (human answers, up to 12k tokens);
  own-answers  the target's own answers to 32 of their user turns (greedy and T = 0.7 in turn,
               up to 256 tokens each): the text a head drafts at inference, as on the bench;
               only the generated answer is scored, not a human's answer in a multi-turn context;
  translations the target's own translations of 32 English paragraphs of their user turns into
               French, German, Spanish, Italian and Portuguese (not in the default: it is only
               worth its ~3 minutes of generation for a head trained on ``sharegpt-translate``).
Per draft position m = 1..passes, over the assistant's tokens, teacher-forced, the head reading
its own guesses at steps > 1:
  greedy[m] = how often the head's argmax equals the target's (greedy acceptance);
  alpha[m]  = mean sum_x min(p(x), q(x)) at temperature T (the acceptance of a sampled draft).

The held-out features are extracted (or generated) once into --workdir (~7 minutes of one core
for 12k tokens at the q4 runtime's prefill on an AVX2 EPYC; ~2.5 minutes on two for the own
answers) and reused.

    .venv/bin/python -m specdec.training.head_eval --workdir /path/to/train-head-workdir [--head FILE] --out eval.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdec.api import TextGenerator
from specdec.models import heads, registry
from specdec.runtime.linear import DEFAULT_DTYPE
from specdec.runtime.native import cpu_name
from specdec.training.run import answer_header, default_workdir, held_out_own_answers, held_out_sharegpt, init_net


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--dtype", default=DEFAULT_DTYPE, help="the runtime whose features the head reads (default: %(default)s)")
    ap.add_argument("--head", default=None, help="head file (default: the one shipped for --target)")
    ap.add_argument("--workdir", default=None, help="where the held-out features are cached (default: train-head's)")
    ap.add_argument("--temperatures", default="1.0,0.7", help="comma-separated temperatures for alpha (default: %(default)s)")
    ap.add_argument("--sets", default="sharegpt,own-answers", help="held-out sets, comma-separated (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    gen = TextGenerator.load(args.target, dtype=args.dtype, head=None)
    path = Path(args.head) if args.head else heads.shipped(args.target)
    if path is None:
        raise SystemExit(f"{args.target} has no shipped head: pass --head FILE")
    workdir = Path(args.workdir) if args.workdir else default_workdir(gen.target.name, args.dtype)
    sets = args.sets.split(",")
    if not set(sets) <= {"sharegpt", "own-answers", "translations"}:
        raise SystemExit(f"--sets: choose from sharegpt, own-answers, translations; got {args.sets}")
    full_rows = heads.output_rows(gen.target)  # [V, E] fp32
    try:
        net, card = init_net(path, gen.target, full_rows)
    except ValueError as e:  # a head made for another target
        raise SystemExit(f"--head: {e}") from None
    net.eval()
    head_cfg = net.cfg
    passes = card.get("train_config", {}).get("passes", 3)  # the draft steps it was trained for
    header = answer_header(gen.encode_chat)
    from specdec.training.train import evaluate

    out = {"head": path.name, "target": gen.target.name, "dtype": args.dtype, "cpu": cpu_name(), "sets": {}}
    for name in sets:
        held = (held_out_sharegpt(gen.target, workdir, gen.encode_chat, 1024) if name == "sharegpt" else
                held_out_own_answers(gen.target, workdir, gen.encode_chat, gen.eos_token_ids,
                                     source="sharegpt-translate" if name == "translations" else "sharegpt"))
        result = out["sets"][name] = {"held_out_windows": len(held), "by_temperature": {}}
        for t in [float(x) for x in args.temperatures.split(",")]:
            start = time.perf_counter()
            scores = evaluate(net, held, list(range(len(held))), passes, full_rows, batch=1, answer_header=header,
                              ends=gen.eos_token_ids, temperature=t, last_answer_only=name != "sharegpt")
            scores["seconds"] = round(time.perf_counter() - start, 1)
            result["by_temperature"][str(t)] = scores
            print(f"{name} T={t}: greedy {scores['greedy']}  alpha {scores['alpha']}  ({scores['slots']} answer slots, "
                  f"subset covers the target's argmax {scores['subset_covers_argmax']:.1%}, {scores['seconds']} s)")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

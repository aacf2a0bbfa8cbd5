"""EAGLE-3's fused features against the last layer alone, at equal data (issue 29, item 3).

Two heads are trained from scratch on the same ShareGPT sequences, with the same steps, seed,
labels and vocabulary subset, and scored on the same held-out conversations:
  last   reads the target's last-block output (what the shipped heads read);
  fused  reads a low, a middle and the last block's outputs, each RMS-normalised and projected
         3E -> E (EAGLE-3's fusion; later draft steps read the head's own guess, as before).
The labels are the target's own distribution (from the last block, as always). Both feature sets
come from ONE extraction: the last-only head reads the last E columns of the fused shards.

Stages are resumable (shards and checkpoints in --workdir); a rerun skips what exists.

    nice .venv/bin/python benchmarks/feature_fusion.py --workdir DIR --sequences 96 --out fusion.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from specdec.api import TextGenerator
from specdec.models import heads, registry
from specdec.runtime.linear import DEFAULT_DTYPE
from specdec.training import corpus, features, sharegpt
from specdec.training.head_net import HeadNet
from specdec.training.run import answer_header, held_out_sharegpt
from specdec.training.train import Dataset, TrainConfig, evaluate, head_config, precision, train, vocab_subset


class LastOnly(Dataset):
    """A fused-feature dataset seen through its last E columns (the last block's output)."""

    def __init__(self, fused: Dataset, width: int) -> None:
        self.rows = [(t, h[:, -width:]) for t, h in fused.rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--dtype", default=DEFAULT_DTYPE)
    ap.add_argument("--workdir", type=Path, required=True, help="shards and checkpoints (resumable)")
    ap.add_argument("--corpus", type=Path, default=None,
                    help="a train-head ShareGPT corpus file (default: WORKDIR/corpus-sharegpt-1024.json, built if absent)")
    ap.add_argument("--sequences", type=int, default=96, help="training sequences of 1,024 tokens (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--label-top-k", type=int, default=32)
    ap.add_argument("--held-out-tokens", type=int, default=12_000)
    ap.add_argument("--extract-only", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overhead", action="store_true",
                    help="instead: time the target's verification forward (k+1 = 6 tokens after 256) with and "
                         "without the fused blocks' outputs, interleaved; run on an idle machine")
    args = ap.parse_args()
    if args.overhead:
        return overhead(args)

    gen = TextGenerator.load(args.target, dtype=args.dtype, head=None)
    model = gen.target.model
    layers = features.fused_layers(model.cfg.num_layers)
    encode = lambda msgs: gen.encode_chat(msgs, add_generation_prompt=False)  # noqa: E731
    args.workdir.mkdir(parents=True, exist_ok=True)
    corpus_path = args.corpus or args.workdir / "corpus-sharegpt-1024.json"
    if not corpus_path.exists():
        corpus.save(sharegpt.build(encode, 1024, args.sequences * 1100), corpus_path)
    sequences = corpus.load(corpus_path)["sequences"][: args.sequences]
    tag = "-".join(map(str, layers))
    t = time.perf_counter()  # train-head's own held-out set, under its names (fused)
    held_fused = held_out_sharegpt(gen.target, args.workdir, gen.encode_chat, 1024, args.held_out_tokens, layers)
    features.extract(model, sequences, args.workdir / f"fused-{tag}-train", layers)
    extract_s = time.perf_counter() - t
    if args.extract_only:
        return

    e = model.cfg.hidden_size
    fused = Dataset(features.load_shards(args.workdir / f"fused-{tag}-train"))
    fused.rows = fused.rows[: args.sequences]
    header = answer_header(gen.encode_chat)
    full_rows = heads.output_rows(gen.target)  # [V, E] fp32
    cfg = TrainConfig(steps=args.steps, lr=args.lr, label_top_k=args.label_top_k, warmup=min(20, args.steps // 5))
    train_ids = list(range(len(fused)))
    vocab_ids = vocab_subset([r[0] for r in fused.rows], cfg.vocab_size, gen.eos_token_ids, model.vocab_size, 0.75)
    out = {"target": gen.target.name, "dtype": args.dtype, "cpu": _cpu(), "training_precision": precision(),
           "fused_layers": list(layers) + [model.cfg.num_layers - 1], "train_config": cfg.__dict__,
           "train_sequences": len(fused), "train_tokens": sum(r[0].shape[0] for r in fused.rows),
           "extract_seconds_this_run": round(extract_s, 1), "heads": {}}
    for name in ("last", "fused"):
        hcfg = replace(head_config(model.cfg, cfg), feature_layers=layers if name == "fused" else ())
        net = HeadNet(hcfg, vocab_ids, model.embed, model.final_norm, full_rows[vocab_ids], cfg.seed)
        data, held = (fused, held_fused) if name == "fused" else (LastOnly(fused, e), LastOnly(held_fused, e))
        log = train(net, data, train_ids, cfg, args.workdir / f"fusion-{name}.pt")
        scores = {}
        for temp in (1.0, 0.7):
            scores[str(temp)] = evaluate(net, held, list(range(len(held))), cfg.passes, full_rows, batch=1,
                                         answer_header=header, ends=gen.eos_token_ids, temperature=temp)
        out["heads"][name] = {"training_seconds": round(log["seconds"], 1),
                              "tokens_per_second": round(out["train_tokens"] * cfg.steps * cfg.batch_sequences
                                                         / len(fused) / max(log["seconds"], 1e-9), 1),
                              "final_losses": log["loss"][-1], "held_out": scores}
        print(f"{name}: greedy {scores['1.0']['greedy']}  alpha(T=1) {scores['1.0']['alpha']}  "
              f"alpha(T=0.7) {scores['0.7']['alpha']}  ({scores['1.0']['slots']} slots)", flush=True)
        if args.out:
            args.out.write_text(json.dumps(out, indent=1))


def overhead(args, rounds: int = 40) -> None:
    """Median seconds of a verification forward (6 tokens after a 256-token prefix, batch 1)
    returning the last block's features, and the fused ones (the layer stack cut in three)."""
    import statistics

    gen = TextGenerator.load(args.target, dtype=args.dtype, head=None)
    model = gen.target.model
    layers = features.fused_layers(model.cfg.num_layers)
    prefix = torch.randint(0, 1000, (1, 256), generator=torch.Generator().manual_seed(0))
    block = torch.randint(0, 1000, (1, 6), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(1, 512)
    model(prefix, cache, return_hidden=False)
    times = {"plain (no features)": [], "last block": [], "fused": []}
    options = {"plain (no features)": {}, "last block": {"return_hidden": True},
               "fused": {"return_hidden": True, "hidden_layers": layers}}
    for r in range(rounds + 3):
        for name, kw in options.items():
            start = time.perf_counter()
            model(block, cache, **kw)
            took = time.perf_counter() - start
            cache.truncate(cache.lengths - 6)
            if r >= 3:  # warm-up rounds are not counted
                times[name].append(took)
    med = {n: statistics.median(t) for n, t in times.items()}
    for name, m in med.items():
        print(f"{name}: {m * 1e3:.2f} ms ({m / med['last block']:.3f}x last block)")
    if args.out:
        args.out.write_text(json.dumps({"cpu": _cpu(), "dtype": args.dtype, "rounds": rounds,
                                        "median_ms": {n: round(m * 1e3, 3) for n, m in med.items()}}, indent=1))


def _cpu() -> str:
    from head_eval import cpu_name  # noqa: PLC0415 (this directory is on sys.path when run as a script)

    return cpu_name()


if __name__ == "__main__":
    main()

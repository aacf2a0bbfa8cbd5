"""Head-training throughput: tokens per second of forward + backward + optimizer step on stored
target features, and where the time goes (torch.profiler, self CPU time by op).

    .venv/bin/python -m specdec.training.train_throughput --features DIR [--steps 6] [--batch 4]

Tokens counted are the sequences' real tokens (padding excluded). Run with nothing else on the
machine: it is a timing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specdec.runtime.head import HeadConfig
from specdec.training.head_net import HeadNet
from specdec.training import features
from specdec.training.train import Dataset, TrainConfig, answer_mask, order, pass_losses, pass_losses_top_k, precision

QWEN_HEADER, QWEN_ENDS = [151644, 77091, 198], {151645}  # "<|im_start|>assistant\n", "<|im_end|>"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top-k", type=int, default=0, help="label_top_k (0: full soft labels, the old loss)")
    ap.add_argument("--answers-only", action="store_true", help="train only the assistant's tokens (Qwen's ChatML header)")
    ap.add_argument("--chain-share", type=float, default=1.0, help="train the chains of this share of the slots (with --top-k)")
    args = ap.parse_args()
    data = Dataset(features.load_shards(Path(args.features))[: args.shards])
    e = data.rows[0][1].shape[1]
    # the default target's head shape (Qwen2.5-1.5B: 12 heads, 2 KV heads of 128), random frozen parts
    cfg = HeadConfig(e, 12, 2, 128, 4096, 1e-6, 1e6, True, 151936)
    tc = TrainConfig()
    vocab = torch.arange(tc.vocab_size)
    g = torch.Generator().manual_seed(0)
    net = HeadNet(cfg, vocab, torch.randn(151936, e, generator=g) * 0.02, torch.ones(e),
                  torch.randn(tc.vocab_size, e, generator=g) * 0.02)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)
    ids = list(range(len(data)))

    def step(i: int) -> int:
        tokens, feats, lengths = data.batch(order(ids, i, args.batch, 0))
        if args.top_k:
            trained = answer_mask(tokens, QWEN_HEADER, QWEN_ENDS) if args.answers_only else None
            chains = torch.Generator().manual_seed(i)
            losses = pass_losses_top_k(net, tokens, feats, lengths, tc.passes, args.top_k, trained, args.chain_share, chains)
        else:
            losses = pass_losses(net, tokens, feats, lengths, tc.passes)
        opt.zero_grad(set_to_none=True)
        (sum(losses) / len(losses)).backward()
        opt.step()
        return int(lengths.sum())

    step(0)
    t, n = time.perf_counter(), 0
    for i in range(1, args.steps + 1):
        n += step(i)
    dt = time.perf_counter() - t
    print(f"{precision()}  threads {torch.get_num_threads()}  top-k {args.top_k}  answers-only {args.answers_only}  chain share {args.chain_share:g}  "
          f"{n} tokens in {dt:.1f} s: {n / dt:.0f} tokens/s ({args.steps} steps of {args.batch} sequences)")
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step(args.steps + 1)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()

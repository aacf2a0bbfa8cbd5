"""q4 against q4k in the kernel alone: the default target's gate/up (17,920 x 1,536) and down
(1,536 x 8,960) weights (random, L3-resident), 1 to 300 rows, alternating, best median of 3 rounds.

    python docs/bench-q4k/kernel.py
"""
import torch, time, statistics
from specdec.runtime import q4
torch.manual_seed(0)
for (n, kk) in [(17920, 1536), (1536, 8960)]:
    w = torch.randn(n, kk) * 0.02
    a, b = q4.Q4Linear(q4.quantize_q4(w)), q4.Q4Linear(q4.quantize_q4k(w))
    for M in (1, 5, 9, 12, 16, 17, 32, 300):
        x = torch.randn(M, kk)
        res = {}
        for rep in range(3):
            for name, lin in [("q4", a), ("q4k", b)]:
                ts = []
                for _ in range(9 if M < 100 else 3):
                    t0 = time.perf_counter(); lin(x); ts.append(time.perf_counter() - t0)
                res[name] = min(res.get(name, 1e9), statistics.median(ts) * 1e3)
        print(n, kk, M, " ".join(f"{nm} {t:.3f}" for nm, t in res.items()), f"{res['q4k']/res['q4']:.3f}", flush=True)

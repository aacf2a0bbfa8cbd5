import random, statistics
from specdec.adaptive import AdaptiveK, best_k
class Backoff(AdaptiveK):
    def __init__(self, *a, cap=32, **kw):
        super().__init__(*a, **kw); self.every = self.probe_every; self.cap = cap
    def choose(self, rows=1):
        k = best_k(self.acceptance(), self.draft_cost or 0.0, self.verify_costs(rows), self.k_max)
        if k == 0:
            self._since_spec += 1
            if self._since_spec >= self.every:
                self._since_spec = 0
                self.every = min(self.cap, self.every * 2)
                return min(self.probe_k, self.k_max)
        else:
            self._since_spec = 0; self.every = self.probe_every
        return k
def run(cls, a_true, d, L, seed, **kw):
    rng = random.Random(seed)
    c = cls(k_max=8, **kw)
    v = lambda n: 0.022 * (1 + 0.03 * (n - 1))
    t = 0.0; tok = 0; phase_a = a_true
    while tok < L:
        if isinstance(a_true, tuple): phase_a = a_true[0] if tok < L // 2 else a_true[1]
        k = c.choose()
        acc = 0
        while acc < k and rng.random() < phase_a: acc += 1
        dt_d, dt_v = k * d, v(k + 1)
        t += dt_d + dt_v; tok += acc + 1
        c.observe(k, [acc], dt_d, dt_v)
    return (tok / t) / (1 / v(1))
variants = [("base", AdaptiveK, {}), ("probe1", AdaptiveK, {"probe_k": 1}), ("backoff", Backoff, {}), ("backoff+p1", Backoff, {"probe_k": 1})]
for d in (0.0012, 0.0066):
  for a in (0.0, 0.1, 0.3, 0.5, 0.8, (0.0, 0.8), (0.8, 0.0)):
    row = []
    for name, cls, kw in variants:
        for L in (40, 300):
            row.append(statistics.mean(run(cls, a, d, L, s, **kw) for s in range(40)))
    print(f"d={d*1e3:.1f} a={a} " + " ".join(f"{x:.3f}" for x in row))
print("cols:", [f"{n}@{L}" for n, _, _ in variants for L in (40, 300)])

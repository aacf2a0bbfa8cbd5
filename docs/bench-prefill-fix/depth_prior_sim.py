import random, statistics
from specdec.adaptive import AdaptiveK
class Chained(AdaptiveK):
    def acceptance(self):
        out, prev = [], self.prior_accept
        for a, t in zip(self.accepted, self.tested):
            prev = (a + prev * self.prior_weight) / (t + self.prior_weight)
            out.append(prev)
        return out
def run(cls, a_true, d, L, seed, v1=0.0172, slope=0.07):
    rng = random.Random(seed)
    c = cls(k_max=8)
    v = lambda n: v1 * (1 + slope * (n - 1))
    t = 0.0; tok = 0
    while tok < L:
        k = c.choose()
        acc = 0
        while acc < k and rng.random() < (a_true(acc) if callable(a_true) else a_true): acc += 1
        dt_d, dt_v = k * d, v(k + 1)
        t += dt_d + dt_v; tok += acc + 1
        c.observe(k, [acc], dt_d, dt_v)
    return (tok / t) / (1 / v(1))
def best_fixed(a_true, d, v1=0.0172, slope=0.07):
    from specdec.adaptive import expected_tokens
    v = lambda n: v1 * (1 + slope * (n - 1))
    acc = [a_true(i) if callable(a_true) else a_true for i in range(8)]
    return max(expected_tokens(acc, k) / (k * d + v(k + 1)) * v(1) for k in range(9))
for d in (0.0012, 0.0067):
    for a in (0.3, 0.6, 0.85, 0.95, (lambda i: 0.6 if i == 0 else 0.95)):
        name = a if not callable(a) else "0.6 then 0.95"
        r = [statistics.mean(run(cls, a, d, L, s) for s in range(40)) for cls in (AdaptiveK, Chained) for L in (100, 400)]
        print(f"d={d*1e3:.1f} a={name}: base {r[0]:.3f}/{r[1]:.3f} chained {r[2]:.3f}/{r[3]:.3f} best fixed {best_fixed(a, d):.3f}")

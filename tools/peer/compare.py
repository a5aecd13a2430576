#!/usr/bin/env python3
"""tools/peer/compare.py NANOGRAPH.jsonl PEER.jsonl OUT.png [MODEL] - the two loss curves of a
parity run: mean and max |loss difference| per step, the mean difference and mean |difference|
over each quarter of the steps, and a plot of both (MODEL names the model in its title, d12 by
default)."""
import json, sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def losses(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


a, b = losses(sys.argv[1]), losses(sys.argv[2])
steps = sorted(set(a) & set(b))
d = [abs(a[s] - b[s]) for s in steps]
print(f"parity: {len(steps)} common steps, mean |dloss| {sum(d) / len(d):.4f}, "
      f"max {max(d):.4f} (step {steps[d.index(max(d))]}), last: nanograph {a[steps[-1]]:.4f} "
      f"peer {b[steps[-1]]:.4f}")
q = max(1, len(steps) // 4)
for i in range(0, len(steps), q):
    part = steps[i:i + q]
    dd = [a[s] - b[s] for s in part]
    print(f"parity: steps {part[0]}-{part[-1]}: mean dloss (nanograph - peer) {sum(dd) / len(dd):+.4f}, "
          f"mean |dloss| {sum(map(abs, dd)) / len(dd):.4f}")
model = sys.argv[4] if len(sys.argv) > 4 else "d12"
plt.figure(figsize=(7, 4))
plt.plot(steps, [a[s] for s in steps], label="nanograph (CUDA Graph, bf16)")
plt.plot(steps, [b[s] for s in steps], label="PyTorch peer (torch.compile, bf16 autocast)",
         linestyle="--")
plt.xlabel("step")
plt.ylabel("training loss")
plt.title(f"{model}, same init and data: mean |dloss| = {sum(d) / len(d):.4f}")
plt.legend()
plt.grid(alpha=0.3)
plt.tight_layout()
plt.savefig(sys.argv[3], dpi=110)

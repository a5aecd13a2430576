#!/usr/bin/env python3
"""tools/peer/compare.py NANOGRAPH.jsonl PEER.jsonl OUT.png - the two loss curves of a parity run:
mean and max |loss difference| per step, and a plot of both."""
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
plt.figure(figsize=(7, 4))
plt.plot(steps, [a[s] for s in steps], label="nanograph (CUDA Graph, bf16)")
plt.plot(steps, [b[s] for s in steps], label="PyTorch peer (torch.compile, bf16 autocast)",
         linestyle="--")
plt.xlabel("step")
plt.ylabel("training loss")
plt.title(f"d12, same init and data: mean |dloss| = {sum(d) / len(d):.4f}")
plt.legend()
plt.grid(alpha=0.3)
plt.tight_layout()
plt.savefig(sys.argv[3], dpi=110)

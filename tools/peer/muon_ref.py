#!/usr/bin/env python3
"""tools/peer/muon_ref.py — a plain-PyTorch reference of nanograph's --optimizer muon.

The same GPT-2 (graph/gpt.h: learned token and position embeddings, pre-LN blocks with eps 1e-5,
causal attention, tanh GELU MLP of width 4C, biases everywhere, head tied to wte, the padded
vocabulary's logits ignored), started from the same weights (tools/export_init's flat float32
file), fed the same windows (shards in sorted order, window w = tokens [w*T, w*T + T], as
`nanograph train --no-shuffle` reads them), updated by the same optimizer (kernels/muon.h):

  Muon on every hidden matrix (qkv's three C x C slices separately, attproj, fc, fcproj):
    m = lerp(m, g, 1 - mu); u = lerp(g, m, mu); X = u / (||u|| + 1e-7) (transposed if tall);
    5 x: A = X X^T; B = b A + c A A; X = a X + B X, (a, b, c) = (3.4445, -4.7750, 2.0315);
    W -= lr * max(1, rows / cols)^0.5 * X
  The speedrun's Adam on the rest (wte, wpe: --adam-lr x --adam-embed-mult; biases and
  LayerNorm weights: x --adam-scalar-mult), betas (0.8, 0.95), eps 1e-10, no weight decay:
    p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)
  lr factor 1, then linear over the last --cooldown-frac of the steps to 0.1 at the end;
  mu 0.85 -> 0.95 linearly over 300 steps; no gradient clipping (nanograph's default under
  muon).

It computes in float64 on the CPU, as nanograph's CPU reference does, so the two loss curves
must agree closely; it prints the largest relative difference of the per-step losses and exits 1
when it exceeds --tol (1e-4 by default: float64 on both sides, the sums in other orders).

How to run (from the repository root, with a build in build/; torch and numpy installed):

  python3 tools/peer/muon_ref.py --make-shard /tmp/muon_shards/train_000.bin
  build/tools/export_init tiny 1337 /tmp/tiny_init.bin
  build/nanograph train --device cpu --model tiny --seed 1337 --steps 300 --optimizer muon \\
      --train '/tmp/muon_shards/*.bin' --no-shuffle --metrics /tmp/ours.jsonl
  python3 tools/peer/muon_ref.py --init /tmp/tiny_init.bin --shards '/tmp/muon_shards/*.bin' \\
      --steps 300 --ours /tmp/ours.jsonl

--make-shard writes 2^18 tokens below --vocab of a seeded noisy linear recurrence (learnable, so
the loss falls) in the shard format of data/shard.h. The model flags here (--layers --heads
--channels --seq-len --vocab, --batch) must be nanograph's (tiny: 2 layers, 2 heads, 64
channels, T 64, V 512, batch 8). The same run with --device cuda compares the GPU's bf16 Muon
instead (expect agreement to about 1e-2 rather than --tol's 1e-4).
"""
import argparse
import glob
import json
import math
import sys

import array
import random

try:  # --make-shard needs neither
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None

ALIGN = 64
NAMES = ["wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b",
         "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb"]


def layout(L, C, T, Vp):
    """graph/gpt.h's flat layout: name -> (offset, shape), each tensor at a multiple of 64."""
    shapes = {"wte": (Vp, C), "wpe": (T, C), "ln1w": (L, C), "ln1b": (L, C),
              "qkvw": (L, 3 * C, C), "qkvb": (L, 3 * C), "attprojw": (L, C, C),
              "attprojb": (L, C), "ln2w": (L, C), "ln2b": (L, C), "fcw": (L, 4 * C, C),
              "fcb": (L, 4 * C), "fcprojw": (L, C, 4 * C), "fcprojb": (L, C), "lnfw": (C,),
              "lnfb": (C,)}
    out, off = {}, 0
    for n in NAMES:
        numel = int(np.prod(shapes[n]))
        out[n] = (off, shapes[n])
        off += (numel + ALIGN - 1) // ALIGN * ALIGN
    return out, off


def forward(P, idx, targets, H, V):
    B, T = idx.shape
    L, C = P["qkvw"].shape[0], P["wte"].shape[1]
    x = P["wte"][idx] + P["wpe"][:T]
    for l in range(L):
        h = F.layer_norm(x, (C,), P["ln1w"][l], P["ln1b"][l], 1e-5)
        qkv = h @ P["qkvw"][l].T + P["qkvb"][l]
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ P["attprojw"][l].T + P["attprojb"][l]
        h = F.layer_norm(x, (C,), P["ln2w"][l], P["ln2b"][l], 1e-5)
        h = F.gelu(h @ P["fcw"][l].T + P["fcb"][l], approximate="tanh")
        x = x + h @ P["fcprojw"][l].T + P["fcprojb"][l]
    x = F.layer_norm(x, (C,), P["lnfw"], P["lnfb"], 1e-5)
    logits = (x @ P["wte"].T)[..., :V]
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def newton_schulz(u, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = u / (u.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        A = x @ x.T
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.T if tall else x


def lr_factor(step, total, cooldown, final=0.1):
    x = step / total
    if x < 1 - cooldown:
        return 1.0
    w = max((1 - x) / cooldown, 0.0)
    return w + (1 - w) * final


def matrices(P, name, C):
    """The Muon matrices of a parameter: views of (rows, cols) into it."""
    W = P[name]
    if name == "qkvw":
        return [W[l, j * C:(j + 1) * C] for l in range(W.shape[0]) for j in range(3)]
    return [W[l] for l in range(W.shape[0])]


def make_shard(path, n, V, seed=1):
    """n tokens of t[i+1] = (5 t[i] + 3 + noise) mod V, noise in {0, 1, 2}, as a shard."""
    rng = random.Random(seed)
    t = array.array("H", [0]) * n
    for i in range(1, n):
        t[i] = (5 * t[i - 1] + 3 + rng.randrange(3)) % V
    hdr = array.array("i", [0]) * 256
    hdr[0], hdr[1], hdr[2] = 20240520, 1, n
    with open(path, "wb") as f:  # little-endian hosts, as the shard format is
        f.write(hdr.tobytes())
        f.write(t.tobytes())
    print(f"muon_ref: {n} tokens below {V} -> {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--make-shard", metavar="PATH", help="write a token shard and exit")
    ap.add_argument("--init", help="tools/export_init's flat float32 file")
    ap.add_argument("--shards", help="glob of token shards")
    ap.add_argument("--ours", help="nanograph's --metrics JSONL to compare with")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--muon-lr", type=float, default=0.05)
    ap.add_argument("--adam-lr", type=float, default=0.008)
    ap.add_argument("--adam-embed-mult", type=float, default=1.0)
    ap.add_argument("--adam-scalar-mult", type=float, default=5.0)
    ap.add_argument("--cooldown-frac", type=float, default=0.4)
    ap.add_argument("--momentum-warmup", type=int, default=300)
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    if a.make_shard:
        make_shard(a.make_shard, 1 << 18, a.vocab)
        return
    if not a.init or not a.shards:
        ap.error("--init and --shards are needed (or --make-shard)")
    if torch is None:
        sys.exit("muon_ref: needs torch and numpy")
    torch.set_default_dtype(torch.float64)
    L, H, C, T, V, B = a.layers, a.heads, a.channels, a.seq_len, a.vocab, a.batch
    Vp = (V + 127) // 128 * 128
    lay, total = layout(L, C, T, Vp)
    flat = np.fromfile(a.init, dtype=np.float32)
    assert flat.size == total, f"{a.init}: {flat.size} floats, the layout has {total}"
    P = {n: torch.tensor(flat[o:o + int(np.prod(s))].astype(np.float64)).view(*s)
         .requires_grad_(True) for n, (o, s) in lay.items()}
    toks = []
    for path in sorted(glob.glob(a.shards)):
        raw = np.fromfile(path, dtype=np.uint8)
        hdr = raw[:1024].view(np.int32)
        assert hdr[0] == 20240520, f"{path}: not a shard"
        toks.append(raw[1024:1024 + 2 * int(hdr[2])].view(np.uint16))
    wins = [t[w * T:w * T + T + 1] for t in toks for w in range((len(t) - 1) // T)]
    per_epoch = len(wins) // B
    assert per_epoch > 0, "fewer windows than one batch"
    muon_names = ["qkvw", "attprojw", "fcw", "fcprojw"]
    mom = {n: [torch.zeros_like(m) for m in matrices(P, n, C)] for n in muon_names}
    am = {n: torch.zeros_like(P[n]) for n in NAMES if n not in muon_names}
    av = {n: torch.zeros_like(P[n]) for n in NAMES if n not in muon_names}
    b1, b2, eps = 0.8, 0.95, 1e-10
    ours = {}
    if a.ours:
        for line in open(a.ours):
            r = json.loads(line)
            if "loss" in r:
                ours[r["step"]] = r["loss"]
    worst = 0.0
    for step in range(a.steps):
        k = step % per_epoch
        batch = torch.tensor(np.stack(wins[k * B:(k + 1) * B]).astype(np.int64))
        loss = forward(P, batch[:, :-1], batch[:, 1:], H, V)
        for p in P.values():
            p.grad = None
        loss.backward()
        f = lr_factor(step, a.steps, a.cooldown_frac)
        mu = 0.85 + 0.10 * min(step / a.momentum_warmup, 1.0) if a.momentum_warmup else 0.95
        t = step + 1
        with torch.no_grad():
            for n in muon_names:
                for W, G, m in zip(matrices(P, n, C), matrices({n: P[n].grad}, n, C), mom[n]):
                    m.lerp_(G, 1 - mu)
                    u = G.lerp(m, mu)
                    scale = max(1.0, W.shape[0] / W.shape[1]) ** 0.5
                    W -= a.muon_lr * f * scale * newton_schulz(u)
            for n in am:
                mult = a.adam_embed_mult if n in ("wte", "wpe") else a.adam_scalar_mult
                g = P[n].grad
                am[n].mul_(b1).add_(g, alpha=1 - b1)
                av[n].mul_(b2).addcmul_(g, g, value=1 - b2)
                alpha = a.adam_lr * mult * f * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                P[n] -= alpha * am[n] / (av[n].sqrt() + eps)
        l = loss.item()
        if step + 1 in ours:
            worst = max(worst, abs(ours[step + 1] - l) / abs(l))
        if (step + 1) % 25 == 0 or step == 0:
            print(f"step {step + 1:4d} | loss {l:.6f}" +
                  (f" | ours {ours[step + 1]:.6f}" if step + 1 in ours else ""))
    if ours:
        ok = worst <= a.tol
        print(f"largest relative loss difference over {a.steps} steps: {worst:.3e} "
              f"({'within' if ok else 'above'} --tol {a.tol:g})")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""tools/peer/speedrun_peer.py - the speedrun model (graph/gpt.h arch NG_ARCH_SPEEDRUN) in
PyTorch, written with standard modules: one nn.Module per block, nn.Linear without bias (qkv one
(3C, C) Linear), nn.Embedding, weightless F.rms_norm, attention through
F.scaled_dot_product_attention with an explicit boolean mask on the CPU and flex_attention with
the same mask on CUDA. It is the independent implementation the CPU reference
(graph/cpu_spr.c) is checked against, and the PyTorch side of speed and loss comparisons.

The model (graph/cpu_spr.h states it; these are the same choices):
  - B sequences of T tokens; rotary position = index in the sequence; a document starts at each
    token equal to bos = V - 1 (<|endoftext|> = 50256 for GPT-2's vocabulary);
  - block-granular window, as the speedrun's reference: with n = W in a long-window block (0,
    L/3, L-1) and max(1, W // 2) in the others, query t sees key s when t // 128 - s // 128 < n
    (its own 128-token block and the n - 1 before it), on top of causal and same-document;
  - the head covers all Vp columns, and so does the loss, summed over the tokens;
  - the value mixing v = a0 v + a1 ve (a0 v in blocks without a value embedding), the x0 mixing
    x = l0 x + l1 x0, the U-net skips x = x + skipw[j] * (output of block L/2 - 1 - j).
Weights load from graph/gpt.h's flat layout (layout() and load_flat() say where each goes).

Modes:
  --check  float64 on the CPU: runs build/tools/spr_ref_dump (one forward + backward of our CPU
           reference with randomised weights and tokens, two or more document starts) for each
           window of --windows, with the exact head and the simulated FP8 head (unless
           --no-fp8-check), and prints the loss and every gradient's max relative difference
           against it, plus our FP8 rounding against torch's float8 casts. Measured: ~2e-14 on
           speedrun-tiny (5 s) and on the full speedrun preset at B=1 T=200 (160 s, 14 GiB).
             python3 tools/peer/speedrun_peer.py --check [--model speedrun-tiny] [--batch 2]
                 [--seq 200] [--windows 1,3] [--build build]
  --check-train  float64 on the CPU: the whole recipe (model, Muon and Adam with their lr,
           momentum and window schedules; SpeedrunOptimizer, written from the recipe's text)
           trained for --steps from export_init's weights, here and by `nanograph train --device
           cpu --optimizer muon` on the same shard of random tokens: every step's loss and the
           final weights compared (check_train says how). Measured on speedrun-tiny, 30 steps
           with --muon-momentum-warmup 10 (window 1 -> 14, the momentum past its cap, the
           cooldown): losses within 8e-7 (ours printed to 6 digits), weights within 5e-8
           relative L2 (float32 storage); ~45 s. 300 steps: losses within 9.5e-7.
             python3 tools/peer/speedrun_peer.py --check-train --steps 30 \
                 --muon-momentum-warmup 10 [--seed N] [--build build]
  training on a GPU: bf16 autocast, torch.compile, AdamW or --optimizer muon (the speedrun's:
           Newton-Schulz in bf16), the exact head in bf16 or --head-fp8 the reference's FP8 head
           simulated, window ramp W = max(1, ceil(13.5 step / steps)); --val GLOB validates
           every --val-every steps at the step's window, as the reference does
           (tools/speedrun-race peer runs it beside ours and the reference):
             python3 tools/peer/speedrun_peer.py --model speedrun --init init.bin \
                 --train 'shards/train_*.bin' --steps 100 [--optimizer muon]
           (init.bin from build/tools/export_init speedrun SEED init.bin; --optimizer muon has
           not run on a GPU yet).
"""
import argparse, glob, json, math, os, subprocess, sys, tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ALIGN = 64             # graph/gpt.h NG_PARAM_ALIGN
RMS_EPS = 1.1920929e-7  # NG_SPR_RMS_EPS
ATTN_SCALE = 0.12      # NG_SPR_ATTN_SCALE
SOFTCAP, SOFTCAP_DIV = 30.0, 7.5
WINDOW_BLOCK = 128     # NG_SPR_WINDOW_BLOCK
N_VE = 3               # NG_SPR_VE

# name: (layers, heads, channels, context, vocabulary) -- graph/gpt.c's speedrun presets
PRESETS = {"speedrun": (12, 6, 768, 49152, 50257), "speedrun-tiny": (6, 2, 64, 512, 512)}


def padded_vocab(V):
    return (V + 127) // 128 * 128


# graph/gpt.h's per-block rules (ng_spr_*)
def no_attn(L):
    return L * 7 // 12


def attn_slot(L, l):
    n = no_attn(L)
    return -1 if l == n else (l if l < n else l - 1)


def long_window(L, l):
    return l == 0 or l == L // 3 or l == L - 1


def ve_table(L, l):
    if l < N_VE:
        return l
    if l >= L - N_VE:
        return l - (L - N_VE)
    return -1


def block_window(L, l, W):
    """Block l's window in tokens, whole 128-token blocks (graph/cpu_spr.h
    ng_cpu_spr_block_window)."""
    return max(1, W if long_window(L, l) else W // 2) * WINDOW_BLOCK


def window_blocks(step, steps):
    """The window in 128-token blocks at 0-based step `step` of `steps`: max(1, ceil(13.5 step /
    steps)), in integers (graph/step_spr.h ng_spr_window_blocks)."""
    return max(1, (27 * step + 2 * steps - 1) // (2 * steps)) if steps > 0 else 1


@torch.no_grad()
def validate(model, step_fn, wins, W, dev):
    """The mean loss over the validation windows (one sequence at a time) at window W, the
    head exact (the reference validates without its FP8 head)."""
    from steptime import to_device
    fp8, model.head_fp8 = model.head_fp8, False
    total = 0.0
    for w in wins:
        xy = to_device(np.asarray(w)[None], dev)
        masks = model.masks(xy[:, :-1], W)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            total += float(step_fn(xy[:, :-1], xy[:, 1:], W, masks)) / (xy.size(1) - 1)
    model.head_fp8 = fp8
    return total / len(wins)


def layout(L, C, Vp):
    """graph/gpt.h's flat layout for the speedrun family, in enum ng_param_id order (the GPT-2
    tensors it lacks take no space): {name: (shape, offset)} and the total."""
    La = L - 1
    specs = [("wte", (Vp, C)), ("qkvw", (La, 3 * C, C)), ("attprojw", (La, C, C)),
             ("fcw", (L, 4 * C, C)), ("fcprojw", (L, C, 4 * C)), ("ve", (N_VE, Vp, C)),
             ("headw", (Vp, C)), ("xlambda", (L, 2)), ("vlambda", (La, 2)), ("skipw", (L // 2,))]
    out, off = {}, 0
    for name, shape in specs:
        n = int(np.prod(shape))
        out[name] = (shape, off)
        off += (n + ALIGN - 1) // ALIGN * ALIGN
    return out, off


def norm(x):
    return F.rms_norm(x, (x.size(-1),), eps=RMS_EPS)


class Rotary(nn.Module):
    """Half-truncated rotary: pair i is (x[i], x[i + D/2]); pairs i < D/4 turn at angular
    frequency (1/1024)^(i / (D/4 - 1)), the others not at all."""

    def __init__(self, D, T):
        super().__init__()
        q = D // 4
        freq = (1 / 1024) ** torch.linspace(0, 1, steps=q, dtype=torch.float64) if q > 1 \
            else torch.ones(1, dtype=torch.float64)
        freq = torch.cat([freq, freq.new_zeros(D // 2 - q)])
        theta = torch.arange(T, dtype=torch.float64)[:, None] * freq[None, :]
        self.register_buffer("cos", theta.cos(), persistent=False)  # (T, D/2)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x):  # (B, T, H, D)
        T, h = x.size(1), x.size(-1) // 2
        c, s = self.cos[None, :T, None, :].to(x.dtype), self.sin[None, :T, None, :].to(x.dtype)
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat([x1 * c + x2 * s, -x1 * s + x2 * c], dim=-1)


class Attention(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.qkv = nn.Linear(C, 3 * C, bias=False)  # rows: q | k | v, heads inside each
        self.proj = nn.Linear(C, C, bias=False)
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))

    def forward(self, x, ve, mask, rotary):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, C // self.H).unbind(2)
        q, k = rotary(norm(q)), rotary(norm(k))
        v = self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v) if ve is not None \
            else self.lambdas[0] * v
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if isinstance(mask, torch.Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=ATTN_SCALE)
        else:
            from torch.nn.attention.flex_attention import flex_attention
            y = flex_attention(q, k, v, block_mask=mask, scale=ATTN_SCALE)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.fc = nn.Linear(C, 4 * C, bias=False)
        self.proj = nn.Linear(4 * C, C, bias=False)

    def forward(self, x):
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    def __init__(self, C, H, has_attn):
        super().__init__()
        self.attn = Attention(C, H) if has_attn else None
        self.mlp = MLP(C)
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))

    def forward(self, x, x0, ve, mask, rotary):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(norm(x), ve, mask, rotary)
        return x + self.mlp(norm(x))


def round_fp8(x, mbits, emin, maxv):
    """x rounded to the FP8 format of `mbits` mantissa bits, smallest normal exponent `emin`
    and largest finite `maxv`: nearest even, saturating, in x's own dtype. torch's casts take
    a float64 through float32 first, and that double rounding moves a value just past a
    midpoint onto it (1.125 + 1e-12 becomes E5M2 1.0, not 1.25), which the float64 check
    would count as a difference; the reference's fp32 and bf16 inputs have no such step."""
    a = x.abs()
    _, e = torch.frexp(a)                       # a = m 2^e, m in [0.5, 1)
    q = torch.ldexp(torch.ones_like(a), torch.clamp(e - 1, min=emin) - mbits)
    r = torch.clamp(torch.round(a / q) * q, max=maxv)  # a / q is exact; round: half to even
    return torch.where(torch.isnan(x), x, torch.copysign(r, x))


def e4m3(x):
    return round_fp8(x, 3, -6, 448.0)


def e5m2(x):
    return round_fp8(x, 2, -14, 57344.0)


class FP8Head(torch.autograd.Function):
    """The reference's FP8 head, simulated in the input's dtype: x8 = e4m3(x / xs), w8 =
    e4m3(w / ws), z = (x8 @ w8^T) xs ws; backward g8 = e5m2(dz / gs), dx = (g8 @ w8) gs ws,
    dw = (g8^T @ x8) gs xs (graph/cpu_spr.h). Every E4M3 and E5M2 value is exact in bf16, so
    under autocast the products take bf16 operands; dw accumulates in at least fp32 (the
    reference's FP8 GEMM writes it in fp32) and comes back in w's dtype."""

    @staticmethod
    def forward(ctx, x, w, xs, ws, gs):
        x8 = e4m3(x / xs)
        w8 = e4m3(w / ws).to(x8.dtype)
        ctx.save_for_backward(x8, w8)
        ctx.scales, ctx.dtypes = (xs, ws, gs), (x.dtype, w.dtype)
        return (x8 @ w8.t()) * (xs * ws)

    @staticmethod
    def backward(ctx, dz):
        x8, w8 = ctx.saved_tensors
        xs, ws, gs = ctx.scales
        x_dt, w_dt = ctx.dtypes
        g8 = e5m2(dz / gs)
        acc = torch.promote_types(g8.dtype, torch.float32)
        g2 = g8.reshape(-1, g8.size(-1))
        dx = ((g8 @ w8.to(g8.dtype)) * (gs * ws)).to(x_dt)
        dw = (g2.t().to(acc) @ x8.reshape(-1, x8.size(-1)).to(acc)) * (gs * xs)
        return dx, dw.to(w_dt), None, None, None


class SpeedrunGPT(nn.Module):
    def __init__(self, L, H, C, T, V, Vp, head_fp8=False):
        super().__init__()
        self.L, self.C, self.V, self.Vp, self.head_fp8 = L, C, V, Vp, head_fp8
        self.bos = V - 1
        self.embed = nn.Embedding(Vp, C)
        self.value_embeds = nn.ModuleList(nn.Embedding(Vp, C) for _ in range(N_VE))
        self.blocks = nn.ModuleList(Block(C, H, attn_slot(L, l) >= 0) for l in range(L))
        self.lm_head = nn.Linear(C, Vp, bias=False)
        self.skip_weights = nn.Parameter(torch.ones(L // 2))
        self.rotary = Rotary(C // H, T)

    def masks(self, idx, W):
        """Per block: the boolean (B, 1, T, T) mask of SDPA on the CPU, a flex_attention
        BlockMask on CUDA; True where query t sees key s."""
        B, T = idx.shape
        doc = (idx == self.bos).cumsum(1)
        wins = sorted({block_window(self.L, l, W) for l in range(self.L)})
        if idx.device.type == "cuda":
            from torch.nn.attention.flex_attention import create_block_mask
            out = {}
            for w in wins:
                def mask_mod(b, h, q, kv, n=w // WINDOW_BLOCK):
                    return ((kv <= q) & (q // WINDOW_BLOCK - kv // WINDOW_BLOCK < n) &
                            (doc[b, kv] == doc[b, q]))
                out[w] = create_block_mask(mask_mod, B, None, T, T, device=idx.device)
        else:
            t = torch.arange(T, device=idx.device)
            causal = t[None, :] <= t[:, None]
            same = doc[:, :, None] == doc[:, None, :]
            blk = t // WINDOW_BLOCK
            out = {w: (causal & (blk[:, None] - blk[None, :] < w // WINDOW_BLOCK) & same)[:, None]
                   for w in wins}
        return [out[block_window(self.L, l, W)] for l in range(self.L)]

    def forward(self, idx, targets, W, masks=None):
        """The summed loss; masks (from self.masks(idx, W)) may be made outside a compiled
        forward."""
        if masks is None:
            masks = self.masks(idx, W)
        x = x0 = norm(self.embed(idx))
        ves = [self.value_embeds[ve_table(self.L, l)](idx) if ve_table(self.L, l) >= 0 and
               self.blocks[l].attn is not None else None for l in range(self.L)]
        skips, n = [], self.L // 2
        for l, block in enumerate(self.blocks):
            if l >= n:
                x = x + self.skip_weights[l - n] * skips.pop()
            x = block(x, x0, ves[l], masks[l], self.rotary)
            if l < n:
                skips.append(x)
        x = norm(x)
        if self.head_fp8:
            z = FP8Head.apply(x, self.lm_head.weight, math.sqrt(self.C) / 448, 24 / 448, 1 / 448)
        else:
            z = self.lm_head(x)
        if z.dtype in (torch.bfloat16, torch.float16):
            z = z.float()  # the logits in fp32, as the reference's
        s = SOFTCAP * torch.sigmoid(z / (SOFTCAP_DIV * math.sqrt(self.C)))
        return F.cross_entropy(s.reshape(-1, self.Vp), targets.reshape(-1), reduction="sum")


def param_map(model):
    """graph/gpt.h's tensor name -> the parameters it fills: [(param, slice index or None)]."""
    L = model.L
    m = {"wte": [(model.embed.weight, None)], "headw": [(model.lm_head.weight, None)],
         "skipw": [(model.skip_weights, None)],
         "ve": [(model.value_embeds[t].weight, t) for t in range(N_VE)],
         "fcw": [(model.blocks[l].mlp.fc.weight, l) for l in range(L)],
         "fcprojw": [(model.blocks[l].mlp.proj.weight, l) for l in range(L)],
         "xlambda": [(model.blocks[l].lambdas, l) for l in range(L)]}
    att = [(l, attn_slot(L, l)) for l in range(L) if attn_slot(L, l) >= 0]
    m["qkvw"] = [(model.blocks[l].attn.qkv.weight, s) for l, s in att]
    m["attprojw"] = [(model.blocks[l].attn.proj.weight, s) for l, s in att]
    m["vlambda"] = [(model.blocks[l].attn.lambdas, s) for l, s in att]
    return m


def load_flat(model, flat):
    """Copy the flat parameters (graph/gpt.h's layout) into the model; every parameter is set."""
    lay, total = layout(model.L, model.C, model.Vp)
    assert flat.size == total, f"flat parameters have {flat.size} values, layout needs {total}"
    done = set()
    with torch.no_grad():
        for name, targets in param_map(model).items():
            shape, off = lay[name]
            src = torch.from_numpy(np.array(flat[off:off + int(np.prod(shape))]))  # a copy
            src = src.reshape(shape)
            for p, i in targets:
                t = src if i is None else src[i]
                assert p.shape == t.shape, f"{name}: {tuple(p.shape)} against {tuple(t.shape)}"
                p.copy_(t.to(p.dtype))
                done.add(id(p))
    left = [n for n, p in model.named_parameters() if id(p) not in done]
    assert not left, f"parameters the flat file does not set: {left}"


def named_tensors(model):
    """The model's parameters under the names of our speedrun model files (src/checkpoint.c):
    wte and ve.<t> their V real rows, blocks.<l>.<name> a block's slice, headw, skipw."""
    V = model.V
    out = {"wte": model.embed.weight[:V], "headw": model.lm_head.weight,
           "skipw": model.skip_weights}
    for t in range(N_VE):
        out["ve.%d" % t] = model.value_embeds[t].weight[:V]
    for l, b in enumerate(model.blocks):
        out["blocks.%d.xlambda" % l] = b.lambdas
        out["blocks.%d.fcw" % l] = b.mlp.fc.weight
        out["blocks.%d.fcprojw" % l] = b.mlp.proj.weight
        if b.attn is not None:
            out["blocks.%d.qkvw" % l] = b.attn.qkv.weight
            out["blocks.%d.attprojw" % l] = b.attn.proj.weight
            out["blocks.%d.vlambda" % l] = b.attn.lambdas
    return out


# The speedrun's optimizer as its text states it (the recipe's "Optimizers"): Muon on every
# hidden matrix, Adam on the rest, one schedule.
NS_ABC = (3.4445, -4.7750, 2.0315)


def newton_schulz(u, steps=5, bf16=False):
    """Orthogonalise u (..., rows, cols), each matrix on its own: X = u / (|u|_F + 1e-7), as
    (cols, rows) when rows > cols, then `steps` times A = X X^T, B = b A + (c A) A,
    X = a X + B X. bf16: in bfloat16 (the reference's precision on a GPU), else in u's dtype."""
    a, b, c = NS_ABC
    x = u.bfloat16() if bf16 else u
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.transpose(-2, -1)
    x = x / (torch.linalg.matrix_norm(x.float() if bf16 else x, keepdim=True).to(x.dtype) + 1e-7)
    for _ in range(steps):
        A = x @ x.transpose(-2, -1)
        B = b * A + (c * A) @ A
        x = a * x + B @ x
    if tall:
        x = x.transpose(-2, -1)
    return x.to(u.dtype)


class SpeedrunOptimizer:
    """Muon (Nesterov momentum in lerp form, Newton-Schulz, lr x max(1, rows/cols)^0.5, the
    qkv matrix as its three (C, C) slices) on the hidden matrices; Adam with the bias
    correction in the step size and eps on the uncorrected root, per group: embeddings and
    value embeddings x75, head x27.5, scalars x5. Every lr is constant, then falls linearly
    over the last `cooldown` of the steps to `final` x; the momentum rises linearly over
    `mu_warmup` steps. No weight decay, no clipping."""

    def __init__(self, model, steps, muon_lr=0.05, adam_lr=0.008, mu=(0.85, 0.95),
                 mu_warmup=300, betas=(0.8, 0.95), eps=1e-10, cooldown=0.4, final=0.1,
                 bf16_ns=False):
        self.steps, self.muon_lr, self.mu, self.mu_warmup = steps, muon_lr, mu, mu_warmup
        self.betas, self.eps, self.cooldown, self.final = betas, eps, cooldown, final
        self.bf16_ns = bf16_ns
        self.muon = []  # (parameter, how many matrices it stacks on dim 0)
        for b in model.blocks:
            if b.attn is not None:
                self.muon += [(b.attn.qkv.weight, 3), (b.attn.proj.weight, 1)]
            self.muon += [(b.mlp.fc.weight, 1), (b.mlp.proj.weight, 1)]
        emb = [model.embed.weight] + [t.weight for t in model.value_embeds]
        scal = [model.skip_weights] + [b.lambdas for b in model.blocks] + \
            [b.attn.lambdas for b in model.blocks if b.attn is not None]
        self.adam = [(p, adam_lr * 75) for p in emb] + [(model.lm_head.weight, adam_lr * 27.5)] + \
            [(p, adam_lr * 5) for p in scal]
        self.state = {}

    def lr_factor(self, step):
        x = step / self.steps
        if x < 1 - self.cooldown:
            return 1.0
        w = max((1 - x) / self.cooldown, 0.0)
        return w + (1 - w) * self.final

    @torch.no_grad()
    def step(self, step):
        """The update of 0-based step `step`."""
        f = self.lr_factor(step)
        mu = self.mu[0] + (self.mu[1] - self.mu[0]) * min(step / self.mu_warmup, 1.0) \
            if self.mu_warmup > 0 else self.mu[1]
        for p, k in self.muon:
            g = p.grad.view(k, -1, p.size(-1))
            m = self.state.setdefault(p, torch.zeros_like(g))
            m.lerp_(g, 1 - mu)
            x = newton_schulz(g.lerp(m, mu), bf16=self.bf16_ns)
            scale = max(1.0, g.size(-2) / g.size(-1)) ** 0.5
            p.view(k, -1, p.size(-1)).sub_(self.muon_lr * f * scale * x.to(p.dtype))
        b1, b2 = self.betas
        t = step + 1
        for p, lr in self.adam:
            g = p.grad.to(torch.float32) if p.dtype == torch.bfloat16 else p.grad
            m, v = self.state.setdefault(p, (torch.zeros_like(g), torch.zeros_like(g)))
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            alpha = lr * f * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            p.sub_((alpha * m / (v.sqrt() + self.eps)).to(p.dtype))


def flat_grads(model):
    """The model's gradients in graph/gpt.h's flat layout (float64; padding zero)."""
    lay, total = layout(model.L, model.C, model.Vp)
    out = np.zeros(total)
    for name, targets in param_map(model).items():
        shape, off = lay[name]
        view = out[off:off + int(np.prod(shape))].reshape(shape)
        for p, i in targets:
            g = p.grad.detach().double().numpy() if p.grad is not None else 0.0
            if i is None:
                view[...] = g
            else:
                view[i] = g
    return out


def read_dump(path):
    """tools/spr_ref_dump.c's file."""
    with open(path, "rb") as f:
        assert f.read(8) == b"NGSPRREF", f"{path}: not a spr_ref_dump file"
        h = np.frombuffer(f.read(64), dtype=np.int32)
        assert h[0] == 1, f"{path}: version {h[0]}"
        total = int(np.frombuffer(f.read(8), dtype=np.int64)[0])
        keys = ["L", "H", "C", "Tctx", "V", "Vp", "B", "T", "window", "head_fp8", "bos", "n8"]
        d = {k: int(v) for k, v in zip(keys, h[1:13])}
        N = d["B"] * d["T"]
        d["params"] = np.frombuffer(f.read(8 * total), dtype=np.float64)
        tok = np.frombuffer(f.read(8 * N), dtype=np.int32)
        d["inputs"] = tok[:N].reshape(d["B"], d["T"])
        d["targets"] = tok[N:].reshape(d["B"], d["T"])
        d["loss"] = float(np.frombuffer(f.read(8), dtype=np.float64)[0])
        d["grads"] = np.frombuffer(f.read(8 * total), dtype=np.float64)
        x8 = np.frombuffer(f.read(24 * d["n8"]), dtype=np.float64).reshape(3, d["n8"])
        d["fp8_x"], d["fp8_e4m3"], d["fp8_e5m2"] = x8
        assert not f.read(1), f"{path}: trailing bytes"
    return d


def check_fp8(d):
    """Our E4M3 / E5M2 rounding against torch's casts, where torch's is finite (torch's casts do
    not saturate: beyond the largest value they give NaN / infinity, ours the largest value)."""
    x = torch.from_numpy(np.array(d["fp8_x"]))
    worst = 0
    for name, dt, ours in (("e4m3", torch.float8_e4m3fn, d["fp8_e4m3"]),
                           ("e5m2", torch.float8_e5m2, d["fp8_e5m2"])):
        t = x.to(dt).double().numpy()
        fin = np.isfinite(t)
        bad = int(np.sum(t[fin] != ours[fin]))
        worst = max(worst, bad)
        print(f"check: fp8 {name}: {int(fin.sum())} values against torch's cast, {bad} differ, "
              f"{int((~fin).sum())} beyond its range (ours saturate)")
    return worst == 0


def check_one(a, W, fp8):
    L, H, C, Tctx, V = PRESETS[a.model]
    L = a.layers or L
    Vp = padded_vocab(V)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ref.bin")
        tool = os.path.join(a.build, "tools", "spr_ref_dump")
        subprocess.run([tool, a.model, str(a.seed), str(a.batch), str(a.seq), str(W),
                        str(int(fp8)), path, str(L)], check=True, stdout=subprocess.DEVNULL)
        d = read_dump(path)
    assert (d["L"], d["H"], d["C"], d["V"], d["Vp"]) == (L, H, C, V, Vp)
    torch.set_default_dtype(torch.float64)
    model = SpeedrunGPT(L, H, C, Tctx, V, Vp, head_fp8=fp8).double()
    assert model.bos == d["bos"]
    load_flat(model, d["params"])
    idx = torch.from_numpy(d["inputs"].astype(np.int64))
    tgt = torch.from_numpy(d["targets"].astype(np.int64))
    loss = model(idx, tgt, W)
    loss.backward()
    lay, _ = layout(L, C, Vp)
    ours, theirs = d["grads"], flat_grads(model)
    dl = abs(loss.item() - d["loss"]) / abs(d["loss"])
    print(f"check: L={L} W={W} fp8={int(fp8)} B={a.batch} T={a.seq} document starts "
          f"{int((idx == model.bos).sum())}: loss peer {loss.item():.15g} ours "
          f"{d['loss']:.15g} rel diff {dl:.3g}")
    worst = dl
    for name, (shape, off) in lay.items():
        n = int(np.prod(shape))
        o, t = ours[off:off + n], theirs[off:off + n]
        scale = max(np.abs(o).max(), np.abs(t).max())
        rel = np.abs(o - t).max() / scale if scale > 0 else 0.0
        worst = max(worst, rel)
        print(f"check:   {name:9s} {str(shape):18s} max |grad| {scale:.3g}  max rel diff "
              f"{rel:.3g}")
    return worst, d


def check(a):
    worst, ok8 = 0.0, True
    for fp8 in ([False, True] if a.fp8_check else [False]):
        for W in (int(w) for w in a.windows.split(",")):
            w, d = check_one(a, W, fp8)
            worst = max(worst, w)
    ok8 = check_fp8(d)
    good = worst < a.tol and ok8
    print(f"check: worst relative difference {worst:.3g} (tolerance {a.tol:g}), fp8 casts "
          f"{'agree' if ok8 else 'DIFFER'}: {'PASS' if good else 'FAIL'}")
    return 0 if good else 1


def check_train(a):
    """float64 on the CPU: a.steps steps of the whole recipe (model, Muon and Adam, the lr,
    momentum and window schedules) from export_init's weights on one shard of random tokens,
    here and in `nanograph train --device cpu --optimizer muon` (our double-precision
    reference, whose constants are float32: these are too); every step's loss and every
    validation must agree to the 6 digits ours prints. Twice: with Adam's eps 1e-3 the weights
    after the last step must agree to float32 storage (relative L2 1e-6); with the recipe's
    1e-10 they are reported, not judged: an element whose gradient is a few 1e-10 (a near
    cancellation, computed to a few digits) takes a sign-like full step either way, and the
    weights drift apart while the losses still agree (seed 1, 300 steps: weights 1.5e-4,
    losses 9.5e-7)."""
    good = True
    for eps, wtol in ((1e-3, 1e-6), (1e-10, None)):
        good &= check_train_once(a, eps, wtol)
    print(f"check-train: {'PASS' if good else 'FAIL'}")
    return 0 if good else 1


def check_train_once(a, eps, wtol):
    from gpt_peer import load_windows
    from ref_eval import read_safetensors
    L, H, C, T, V = PRESETS[a.model]
    T, B, N = a.seq or T, a.batch, a.steps
    Vp = padded_vocab(V)
    exe = os.path.join(a.build, "nanograph")
    with tempfile.TemporaryDirectory() as d:
        init, shard = os.path.join(d, "init.bin"), os.path.join(d, "train_000000.bin")
        subprocess.run([os.path.join(a.build, "tools", "export_init"), a.model, str(a.seed),
                        init], check=True, stdout=subprocess.DEVNULL)
        rng = np.random.default_rng(a.seed)
        n = B * N * T + 1  # a document start (V - 1) about every 300 tokens
        tok = np.where(rng.integers(0, 300, n) == 0, V - 1, rng.integers(0, V - 1, n))
        with open(shard, "wb") as f:
            f.write(np.array([20240520, 1, n] + [0] * 253, dtype=np.int32).tobytes())
            f.write(tok.astype(np.uint16).tobytes())
        metrics, out = os.path.join(d, "m.jsonl"), os.path.join(d, "ck")
        NV, every = 2, max(1, N // 2)  # validations on the first NV windows of the shard
        cmd = [exe, "train", "--device", "cpu", "--model", a.model, "--seq-len", str(T),
               "--batch", str(B), "--optimizer", "muon", "--steps", str(N), "--seed",
               str(a.seed), "--train", shard, "--no-shuffle", "--metrics", metrics, "--out", out,
               "--ckpt-every", str(N), "--muon-momentum-warmup", str(a.muon_momentum_warmup),
               "--adam-eps", str(eps), "--val", shard, "--val-every", str(every),
               "--val-batches", str(NV // B)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        recs = [json.loads(l) for l in open(metrics)]
        ours = [r["loss"] for r in recs if "loss" in r]
        ours_val = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
        final = read_safetensors(os.path.join(out, "model_%08d.safetensors" % N))
        model = SpeedrunGPT(L, H, C, T, V, Vp).double()
        load_flat(model, np.fromfile(init, dtype=np.float32))
        f32 = lambda x: float(np.float32(x))  # ours keeps them so (kernels/muon.h)
        opt = SpeedrunOptimizer(model, N, muon_lr=f32(0.05), adam_lr=f32(0.008),
                                mu=(f32(0.85), f32(0.95)), mu_warmup=a.muon_momentum_warmup,
                                betas=(f32(0.8), f32(0.95)), eps=f32(eps), cooldown=f32(0.4),
                                final=f32(0.1))
        wins = load_windows([shard], T)
        worst, vworst, nval = 0.0, 0.0, 0
        for step in range(N):
            W = window_blocks(step, N)
            xy = torch.from_numpy(np.stack(wins[step * B:(step + 1) * B]).astype(np.int64))
            loss = model(xy[:, :-1], xy[:, 1:], W)
            loss.backward()
            opt.step(step)
            model.zero_grad(set_to_none=True)
            mean = loss.item() / (B * T)
            rel = abs(ours[step] - mean) / mean
            worst = max(worst, rel)
            if a.verbose:
                print(f"check-train: eps {eps:g} step {step + 1} W {W} loss ours "
                      f"{ours[step]:.6f} peer {mean:.9f} rel diff {rel:.2e}")
            if (step + 1) % every == 0 or step + 1 == N:  # ours' validations (train.c)
                v = validate(model, model, wins[:NV], window_blocks(step + 1, N),
                             torch.device("cpu"))
                vrel = abs(ours_val.get(step + 1, float("nan")) - v) / v
                vworst = max(vworst, vrel) if vrel == vrel else float("inf")
                nval += 1
                if a.verbose:
                    print(f"check-train: eps {eps:g} validation after step {step + 1} ours "
                          f"{ours_val.get(step + 1)} peer {v:.9f} rel diff {vrel:.2e}")
        werr = 0.0
        for name, p in named_tensors(model).items():
            got = final[name].double().reshape(-1)
            ref = p.detach().reshape(-1)
            err = ((got - ref).norm() / max(ref.norm().item(), 1e-30)).item()
            big = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            werr = max(werr, err)
            if a.verbose:
                print(f"check-train: {name:18s} {tuple(p.shape)} rel L2 {err:.2e}, largest "
                      f"|ours - peer| / max |peer| {big:.2e}")
    good = len(ours) == N and worst < 1e-5 and vworst < 1e-5 and (wtol is None or werr < wtol)
    print(f"check-train: Adam eps {eps:g}, {N} steps: losses within {worst:.2e}, {nval} "
          f"validations within {vworst:.2e} (6 printed digits: 1e-5), weights within "
          f"{werr:.2e} relative L2 ({'%g' % wtol if wtol else 'not judged'}): "
          f"{'ok' if good else 'FAIL'}")
    return good


def train(a):
    """bf16 autocast, torch.compile; AdamW, or --optimizer muon the speedrun's."""
    from steptime import Meter, summary, to_device
    from gpt_peer import load_windows
    L, H, C, T, V = PRESETS[a.model]
    T = a.seq or T
    Vp = padded_vocab(V)
    dev = torch.device(a.device)
    model = SpeedrunGPT(L, H, C, T, V, Vp, head_fp8=a.head_fp8)
    _, total = layout(L, C, Vp)
    flat = np.fromfile(a.init, dtype=np.float32) if a.init else \
        np.random.default_rng(a.seed).standard_normal(total).astype(np.float32) * 0.02
    load_flat(model, flat)
    model.to(dev)
    for m in model.modules():  # the four embedding tables are bf16, as the reference's (on a
        if isinstance(m, nn.Embedding) and dev.type == "cuda":  # GPU, under autocast)
            m.to(torch.bfloat16)
    if a.optimizer == "muon":  # the speedrun's, Newton-Schulz in bf16 on a GPU
        opt = SpeedrunOptimizer(model, a.steps, mu_warmup=a.muon_momentum_warmup,
                                bf16_ns=dev.type == "cuda")
    else:  # nanograph's AdamW defaults (train --optimizer adamw; nothing decays here)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(a.beta1, 0.95), eps=a.eps,
                                weight_decay=0.0, fused=dev.type == "cuda")
    step_fn = torch.compile(model) if dev.type == "cuda" and not a.no_compile else model
    if a.train:
        wins = load_windows(glob.glob(a.train), T)
        assert len(wins) >= a.batch, "fewer windows than one batch"
    rng = np.random.default_rng(a.seed)
    metrics = open(a.metrics, "w") if a.metrics else None
    meter = Meter("speedrun-peer", a.steps, a.batch * T, metrics)
    vwins = load_windows(glob.glob(a.val), T)[:max(1, a.val_tokens // T)] if a.val else []

    def val_at(done):
        """The validation after `done` steps, at the window of step `done`, its time left out
        of the step times."""
        meter.flush()
        v = validate(model, step_fn, vwins, window_blocks(done, a.steps), dev)
        meter.restart_clock()
        print(f"step {done} | val loss {v:.4f}", flush=True)
        if metrics:
            metrics.write(json.dumps({"step": done, "val_loss": v}) + "\n")
            metrics.flush()

    for step in range(a.steps):
        W = window_blocks(step, a.steps)
        if a.train:
            first = step * a.batch % (len(wins) - a.batch + 1)
            tokens = np.stack(wins[first:first + a.batch])
        else:
            tokens = rng.integers(0, V, size=(a.batch, T + 1))
        xy = to_device(tokens, dev)
        masks = model.masks(xy[:, :-1], W)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = step_fn(xy[:, :-1], xy[:, 1:], W, masks)
        loss.backward()
        if a.optimizer == "muon":
            opt.step(step)
            model.zero_grad(set_to_none=True)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        lr = opt.muon_lr * opt.lr_factor(step) if a.optimizer == "muon" else a.lr
        meter.step(step, lr, loss / (a.batch * T), torch.zeros((), device=dev))
        if vwins and ((step + 1) % a.val_every == 0 or step + 1 == a.steps):
            val_at(step + 1)
    print(summary("speedrun-peer", a.model, a.batch, T, 1, meter, dev), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="float64 check against our CPU "
                    "reference (tools/spr_ref_dump)")
    ap.add_argument("--check-train", action="store_true", help="float64 training check "
                    "against `nanograph train --device cpu --optimizer muon` (--steps)")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                    help="training: nanograph's AdamW defaults, or the speedrun's Muon + Adam")
    ap.add_argument("--muon-momentum-warmup", type=int, default=300,
                    help="muon: steps of the momentum's rise 0.85 -> 0.95 (300)")
    ap.add_argument("--verbose", action="store_true", help="--check-train: every tensor")
    ap.add_argument("--val", help="training: validation shard glob")
    ap.add_argument("--val-every", type=int, default=125, help="training: validate every N "
                    "steps and at the end (125)")
    ap.add_argument("--val-tokens", type=int, default=10485760, help="training: validate on "
                    "the first N // seq sequences of the val shards (10485760, the reference's)")
    ap.add_argument("--head-fp8", action="store_true", help="training: the reference's FP8 "
                    "head (simulated: E4M3 forward, E5M2 gradient, its fixed scales)")
    ap.add_argument("--model", default=None, choices=sorted(PRESETS),
                    help="default speedrun-tiny with --check, speedrun otherwise")
    ap.add_argument("--layers", type=int, default=None, help="--check: another even L >= 6 "
                    "(8 has a block with attention but no value embedding)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None, help="tokens a sequence")
    ap.add_argument("--windows", default="1,3", help="--check: windows (blocks of 128 tokens)")
    ap.add_argument("--no-fp8-check", dest="fp8_check", action="store_false",
                    help="--check: leave out the simulated FP8 head")
    ap.add_argument("--tol", type=float, default=1e-9, help="--check: largest relative "
                    "difference that passes")
    ap.add_argument("--build", default="build", help="--check: the meson build directory")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--init", help="training: flat float32 init from build/tools/export_init")
    ap.add_argument("--train", help="training: token shard glob (else random tokens)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=6e-4, help="training: constant (nanograph's "
                    "AdamW default, with --warmup 0 --lr-final-frac 1 on our side)")
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--metrics", help="training: a JSON line per step (loss, ms) to this file")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    if a.check_train:
        a.model = a.model or "speedrun-tiny"
        a.batch = a.batch or 1
        return check_train(a)
    if a.check:
        a.model = a.model or "speedrun-tiny"
        a.batch = a.batch or 2
        a.seq = a.seq or 200
        return check(a)
    a.model = a.model or "speedrun"
    a.batch = a.batch or 1
    train(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())

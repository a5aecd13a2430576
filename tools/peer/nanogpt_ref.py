#!/usr/bin/env python3
"""tools/peer/nanogpt_ref.py - the speed reference: a plain GPT-2 trainer in the usual
nanoGPT style, with nothing of nanograph in it but the model sizes. tools/bench runs it beside
nanograph and gpt_peer.py, so that a peer written around our layout cannot flatter our ratios:
if gpt_peer.py ever trains slower than this, the comparison is made against this one.

The model is the standard one: CausalSelfAttention (c_attn, c_proj), MLP (c_fc, GELU tanh,
c_proj), pre-LN Block, GPT (wte, wpe, h, ln_f, lm_head tied to wte) over the vocabulary padded to
a multiple of 128 (50304), with the loss over all padded columns; every Linear and Embedding
weight drawn from N(0, 0.02), biases zero. Trained on uniform random tokens (numpy, seeded),
under torch.compile (mode 'default'), bf16 autocast and fused AdamW (betas 0.9/0.95, weight
decay 0.1 on the matrices and embeddings), gradient clipping at 1.0, warm-up and cosine decay.
Data in and timing out are tools/peer/steptime.py's, the same as gpt_peer.py's: the tokens go
to the device through pinned memory, and the speed is the mean of 10-step windows after
step 10. Ends with one line tools/bench reads:
  ref: d12 B=64 T=1024 K=1: N tok/s (...), peak X GiB allocated, Y GiB reserved,
  device in use Z GiB

  python3 tools/peer/nanogpt_ref.py --model d12 --batch 64 --steps 30
  python3 tools/peer/nanogpt_ref.py --model tiny --batch 4 --steps 20 --device cpu
"""
import argparse, math, os, sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from steptime import PRESETS, Meter, padded_vocab, summary, to_device  # noqa: E402


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        hs = C // self.n_head
        qkv = self.c_attn(x)
        q, k, v = (part.view(B, T, self.n_head, hs).transpose(1, 2)
                   for part in qkv.split(C, dim=2))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(out)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size, vocab_size):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def make_optimizer(model, lr, weight_decay, fused):
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def lr_at(step, warmup, total, lr_max, lr_min):
    if step < warmup:
        return lr_max * (step + 1) / warmup
    frac = min(max(step - warmup, 0) / max(total - 1 - warmup, 1), 1.0)
    return lr_min + 0.5 * (lr_max - lr_min) * (1 + math.cos(math.pi * frac))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="d12", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--total-batch", type=int, default=0, help="tokens per step (accumulates)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--metrics", help="a JSON line per step to this file")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-mode", help="torch.compile mode (default: 'default' on a GPU, "
                    "eager on the CPU); 'none' is --no-compile")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sync-every-step", action="store_true",
                    help="read the loss back after every step (as a loop that logs each step "
                    "does), to see what a per-step host sync costs; off by default")
    a = ap.parse_args()
    n_layer, n_head, n_embd, T, V = PRESETS[a.model]
    Vp = padded_vocab(V)
    B = a.batch
    K = max(1, a.total_batch // (B * T)) if a.total_batch else 1
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = GPT(n_layer, n_head, n_embd, T, Vp).to(dev)
    opt = make_optimizer(model, a.lr, a.weight_decay, fused=True)
    mode = "none" if a.no_compile else (a.compile_mode or ("default" if cuda else "none"))
    run = model if mode == "none" else torch.compile(model, mode=mode)
    rng = np.random.default_rng(a.seed)
    out = open(a.metrics, "w") if a.metrics else None
    meter = Meter("ref", a.steps, K * B * T, out)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    for step in range(a.steps):
        lr = lr_at(step, a.warmup, a.steps, a.lr, 0.1 * a.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        total = 0.0
        for _ in range(K):
            xy = to_device(rng.integers(0, V, size=(B, T + 1)), dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = run(xy[:, :-1], xy[:, 1:]) / K
            loss.backward()
            total = total + loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip if a.clip > 0 else 1e30)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if a.sync_every_step:
            total.item()
        meter.step(step, lr, total, norm)
    if out:
        out.close()
    print(summary("ref", a.model, B, T, K, meter, dev), flush=True)


if __name__ == "__main__":
    main()

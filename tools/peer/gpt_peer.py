#!/usr/bin/env python3
"""tools/peer/gpt_peer.py - nanograph's PyTorch peer: the same GPT-2 as nanograph (pre-LN,
biases, GELU tanh, tied head over the padded vocabulary), written the way a tuned PyTorch GPT-2
is written -- one module per layer with its own nn.Linear / nn.LayerNorm parameters,
F.scaled_dot_product_attention(is_causal=True), the whole model under torch.compile, bf16
autocast, fused AdamW -- so that it trains as fast as the usual nanoGPT-style model
(tools/peer/nanogpt_ref.py is that model, kept for the speed comparison only).

What it keeps of nanograph, for loss parity:
  - the initial weights: a flat float32 file from build/tools/export_init in graph/gpt.h's
    layout (stacked (L, ...) tensors, each padded to 64 elements), copied into the per-layer
    modules (load_flat says which tensor goes where);
  - the data order: token shards read window by window in file order, as
    `nanograph train --no-shuffle` reads them;
  - the padded vocabulary: the head's logits are (B, T, Vp) with Vp = 50304, contiguous, and the
    loss sees only the first V columns: with --pad-loss mask (the default) a constant additive
    bias puts -inf on the padded columns (fused into the loss kernel by torch.compile), so, as
    in kernels/loss.cu, padded logits never win and never get gradient, and the padded rows of
    wte (zero in our init) stay zero. --pad-loss slice takes logits[..., :V] instead (the old
    peer's way); --pad-loss full is nanoGPT's own loss over all Vp columns (not our loss: for
    speed comparisons only);
  - AdamW's betas (0.9, 0.95), eps 1e-8, weight decay on wte, wpe and the matrices (not on
    biases and norms), gradient clipping and our learning-rate schedule (graph/cpu_ops.c).
Prints one JSON object per 10 steps (each step's with --metrics FILE) and a closing line
"peer: ... N tok/s ..., peak X GiB allocated, Y GiB reserved, device in use Z GiB" that
tools/bench reads; timing as tools/peer/steptime.py describes.

  python3 tools/peer/gpt_peer.py --model d12 --init init.bin --train 'shards/train_*.bin' \
      --batch 64 --steps 300 [--total-batch N] [--metrics peer.jsonl] [--no-compile]
Without --train it trains on uniform random tokens (seeded by --seed; for speed only); without
--init on random weights. On a machine without a GPU: --device cpu (fp32, no autocast, eager
unless --compile-mode is given), e.g. --model tiny.
"""
import argparse, glob, math, os, sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from steptime import PRESETS, Meter, padded_vocab, summary, to_device  # noqa: E402

ALIGN = 64  # graph/gpt.h NG_PARAM_ALIGN


def layout(L, C, T, Vp):
    """graph/gpt.h's flat layout: (name, shape, offset, decay) in order, and the total size."""
    specs = [("wte", (Vp, C), True), ("wpe", (T, C), True), ("ln1w", (L, C), False),
             ("ln1b", (L, C), False), ("qkvw", (L, 3 * C, C), True), ("qkvb", (L, 3 * C), False),
             ("attprojw", (L, C, C), True), ("attprojb", (L, C), False), ("ln2w", (L, C), False),
             ("ln2b", (L, C), False), ("fcw", (L, 4 * C, C), True), ("fcb", (L, 4 * C), False),
             ("fcprojw", (L, C, 4 * C), True), ("fcprojb", (L, C), False), ("lnfw", (C,), False),
             ("lnfb", (C,), False)]
    out, off = [], 0
    for name, shape, decay in specs:
        n = int(np.prod(shape))
        out.append((name, shape, off, decay))
        off += (n + ALIGN - 1) // ALIGN * ALIGN
    return out, off


# graph/gpt.h's tensors -> this model's parameters: whole tensors, and the per-layer stacks
# whose slice l is h.{l}.<name>. nn.Linear stores (out, in), as graph/gpt.h does.
WHOLE = {"wte": "wte.weight", "wpe": "wpe.weight", "lnfw": "ln_f.weight", "lnfb": "ln_f.bias"}
PER_LAYER = {"ln1w": "ln_1.weight", "ln1b": "ln_1.bias",
             "qkvw": "attn.c_attn.weight", "qkvb": "attn.c_attn.bias",
             "attprojw": "attn.c_proj.weight", "attprojb": "attn.c_proj.bias",
             "ln2w": "ln_2.weight", "ln2b": "ln_2.bias",
             "fcw": "mlp.c_fc.weight", "fcb": "mlp.c_fc.bias",
             "fcprojw": "mlp.c_proj.weight", "fcprojb": "mlp.c_proj.bias"}


class SelfAttention(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.c_attn = nn.Linear(C, 3 * C)  # rows: q (C), k (C), v (C); heads inside each
        self.c_proj = nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.c_fc = nn.Linear(C, 4 * C)
        self.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = SelfAttention(C, H)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = MLP(C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, L, H, C, T, V, Vp, pad_loss="mask"):
        super().__init__()
        self.V, self.Vp, self.pad_loss = V, Vp, pad_loss
        self.wte = nn.Embedding(Vp, C)
        self.wpe = nn.Embedding(T, C)
        self.h = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C, eps=1e-5)
        self.lm_head = nn.Linear(C, Vp, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        bias = torch.zeros(Vp)
        bias[V:] = float("-inf")
        self.register_buffer("pad_bias", bias, persistent=False)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe.weight[:T]
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x)).float()  # (B, T, Vp), contiguous
        if self.pad_loss == "mask":
            logits = logits + self.pad_bias
        elif self.pad_loss == "slice":
            logits = logits[..., :self.V]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def load_flat(model, flat, L, C, T, Vp):
    """Copy graph/gpt.h's flat float32 parameters into the model; returns the names of the
    parameters that take weight decay (ours: wte, wpe and the four matrices per layer)."""
    lay, total = layout(L, C, T, Vp)
    assert flat.size == total, f"init file has {flat.size} floats, layout needs {total}"
    params = dict(model.named_parameters())  # the tied head is wte.weight, once
    done, decay = set(), set()
    with torch.no_grad():
        for name, shape, off, dec in lay:
            src = torch.from_numpy(flat[off:off + int(np.prod(shape))].reshape(shape))
            targets = [(WHOLE[name], src)] if name in WHOLE else \
                [(f"h.{l}.{PER_LAYER[name]}", src[l]) for l in range(L)]
            for pname, t in targets:
                p = params[pname]
                assert p.shape == t.shape, f"{pname}: {tuple(p.shape)} against {tuple(t.shape)}"
                p.copy_(t)
                done.add(pname)
                if dec:
                    decay.add(pname)
    left = set(params) - done
    assert not left, f"parameters the init file does not set: {sorted(left)}"
    return decay


def read_shard(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(1024), dtype=np.int32)
        assert header[0] == 20240520 and header[1] == 1, f"{path}: not a token shard"
        return np.frombuffer(f.read(), dtype=np.uint16)[: header[2]]


def load_windows(paths, T):
    """Every window of T+1 tokens, stride T, shards in sorted order: the loader's file order
    (data/loader.h with shuffle off). An epoch is floor(windows / B) batches."""
    out = []
    for p in sorted(paths):
        tok = read_shard(p)
        out.extend(tok[w * T: w * T + T + 1] for w in range((len(tok) - 1) // T))
    return out


def lr_at(step, warmup, total, lr_max, final_frac, cosine):
    """graph/cpu_ops.c ng_ref_lr."""
    if step < warmup:
        return lr_max * (step + 1) / warmup
    lr_min = lr_max * final_frac
    span = total - 1 - warmup
    if span <= 0:
        return lr_max
    frac = min((step - warmup) / span, 1.0)
    if cosine:
        return lr_min + 0.5 * (lr_max - lr_min) * (1 + math.cos(math.pi * frac))
    return lr_max - (lr_max - lr_min) * frac


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="d12", choices=sorted(PRESETS))
    ap.add_argument("--init", help="flat float32 init from build/tools/export_init (else random)")
    ap.add_argument("--train", help="token shard glob (else uniform random tokens: speed only)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--total-batch", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--lr-final-frac", type=float, default=0.1)
    ap.add_argument("--schedule", default="cosine")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--metrics")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-mode", help="torch.compile mode (default: 'default' on a GPU, "
                    "eager on the CPU); 'none' is --no-compile")
    ap.add_argument("--pad-loss", default="mask", choices=["mask", "slice", "full"],
                    help="how the loss leaves out the padded vocabulary (see the docstring)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0, help="random init and random tokens")
    ap.add_argument("--save", help="after training: the weights as HF GPT-2 safetensors")
    a = ap.parse_args()
    L, H, C, T, V = PRESETS[a.model]
    Vp = padded_vocab(V)
    B = a.batch
    K = max(1, a.total_batch // (B * T)) if a.total_batch else 1
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    _, total = layout(L, C, T, Vp)
    if a.init:
        flat = np.fromfile(a.init, dtype=np.float32)
    else:
        flat = (np.random.default_rng(a.seed).standard_normal(total) * 0.02).astype(np.float32)
        flat[V * C:Vp * C] = 0  # padded rows of wte, zero as in our init
    model = GPT(L, H, C, T, V, Vp, a.pad_loss)
    decay_names = load_flat(model, flat, L, C, T, Vp)
    del flat
    model.to(dev)
    named = list(model.named_parameters())
    decay = [p for n, p in named if n in decay_names]
    nodecay = [p for n, p in named if n not in decay_names]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": nodecay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    mode = "none" if a.no_compile else (a.compile_mode or ("default" if cuda else "none"))
    step_fn = model if mode == "none" else torch.compile(model, mode=mode)
    if a.train:
        paths = glob.glob(a.train)
        assert paths, f"no shard matches {a.train}"
        wins = load_windows(paths, T)
        per_epoch = len(wins) // B
        assert per_epoch > 0, "fewer windows than one batch"
    else:
        rng = np.random.default_rng(a.seed)
    batch_no = 0
    out = open(a.metrics, "w") if a.metrics else None
    meter = Meter("peer", a.steps, K * B * T, out)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    for step in range(a.steps):
        lr = lr_at(step, a.warmup, a.steps, a.lr, a.lr_final_frac, a.schedule == "cosine")
        for g in opt.param_groups:
            g["lr"] = lr
        loss_sum = 0.0
        for k in range(K):
            if a.train:
                first = (batch_no % per_epoch) * B
                tokens = np.stack(wins[first:first + B])
            else:
                tokens = rng.integers(0, V, size=(B, T + 1))
            batch_no += 1
            xy = to_device(tokens, dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = step_fn(xy[:, :-1], xy[:, 1:]) / K
            loss.backward()
            loss_sum = loss_sum + loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip if a.clip > 0 else 1e30)
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter.step(step, lr, loss_sum, norm)
    if out:
        out.close()
    print(summary("peer", a.model, B, T, K, meter, dev), flush=True)
    if a.pad_loss != "full":
        pad = model.wte.weight[V:].abs().max().item() if Vp > V else 0.0
        print(f"peer-check: padded rows of wte after training: max |w| = {pad:g} "
              f"(0: they got no gradient)", flush=True)
    if a.save:
        save_hf(model, a.save, L, H, C, T, V)


def save_hf(model, path, L, H, C, T, V):
    """Hugging Face GPT-2 names and layouts (Conv1D weights stored (in, out), wte unpadded),
    written by the safetensors library -- the file another program would hand to nanograph."""
    from safetensors.torch import save_file
    out = {}
    for n, t in model.named_parameters():
        t = t.detach().float().cpu()
        if n == "wte.weight":
            t = t[:V]
        elif n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            t = t.t()  # Conv1D
        out["transformer." + n] = t.contiguous()
    meta = {"format": "pt", "n_layer": str(L), "n_head": str(H), "n_embd": str(C),
            "n_positions": str(T), "vocab_size": str(V), "writer": "tools/peer/gpt_peer.py"}
    save_file(out, path, metadata=meta)
    print(f"peer: wrote {path} ({len(out)} tensors)", flush=True)


if __name__ == "__main__":
    main()

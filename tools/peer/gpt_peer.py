#!/usr/bin/env python3
"""tools/peer/gpt_peer.py - nanograph's PyTorch peer: the same GPT-2 (pre-LN, tied head over the
padded vocabulary, loss over the first V columns), the same parameter layout and initial
weights (read from a flat float32 file written by build/export_init), the same data order
(token shards read window by window in file order, as `nanograph train --no-shuffle` does),
the same AdamW / clipping / schedule. Run the way docs/GPU.md describes: torch.compile,
bf16 autocast, flash SDPA, fused AdamW. Prints one JSON object per step.

  python3 tools/peer/gpt_peer.py --model d12 --init init.bin --train 'shards/train_*.bin' \
      --batch 64 --steps 300 [--total-batch N] [--metrics peer.jsonl] [--no-compile]
"""
import argparse, glob, json, math, sys, time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {"tiny": (2, 2, 64, 64, 512), "d12": (12, 12, 768, 1024, 50257),
           "d24": (24, 16, 1024, 1024, 50257), "d36": (36, 20, 1280, 1024, 50257),
           "d48": (48, 25, 1600, 1024, 50257)}
ALIGN = 64  # graph/gpt.h NG_PARAM_ALIGN


def layout(L, C, T, Vp):
    """graph/gpt.h's flat layout: (name, shape, offset, decay) in order."""
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


class GPT(nn.Module):
    def __init__(self, L, H, C, T, V, Vp, flat):
        super().__init__()
        self.L, self.H, self.C, self.V = L, H, C, V
        lay, total = layout(L, C, T, Vp)
        assert flat.size == total, f"init file has {flat.size} floats, layout needs {total}"
        self.decay = {}
        for name, shape, off, decay in lay:
            n = int(np.prod(shape))
            t = torch.from_numpy(flat[off:off + n].reshape(shape).copy())
            self.register_parameter(name, nn.Parameter(t))
            self.decay[name] = decay

    def forward(self, idx, targets):
        B, T = idx.shape
        C, H = self.C, self.H
        x = self.wte[idx] + self.wpe[:T]
        for l in range(self.L):
            h = F.layer_norm(x, (C,), self.ln1w[l], self.ln1b[l], 1e-5)
            qkv = F.linear(h, self.qkvw[l], self.qkvb[l]).view(B, T, 3, H, C // H)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(B, T, C)
            x = x + F.linear(y, self.attprojw[l], self.attprojb[l])
            h = F.layer_norm(x, (C,), self.ln2w[l], self.ln2b[l], 1e-5)
            h = F.gelu(F.linear(h, self.fcw[l], self.fcb[l]), approximate="tanh")
            x = x + F.linear(h, self.fcprojw[l], self.fcprojb[l])
        x = F.layer_norm(x, (C,), self.lnfw, self.lnfb, 1e-5)
        logits = F.linear(x, self.wte)[..., :self.V]
        return F.cross_entropy(logits.float().reshape(-1, self.V), targets.reshape(-1))


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
    ap.add_argument("--model", default="d12")
    ap.add_argument("--init", help="flat float32 init from build/export_init (else random)")
    ap.add_argument("--train", required=True)
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
    ap.add_argument("--save", help="after training: the weights as HF GPT-2 safetensors")
    a = ap.parse_args()
    L, H, C, T, V = PRESETS[a.model]
    Vp = (V + 127) // 128 * 128
    B = a.batch
    K = max(1, a.total_batch // (B * T)) if a.total_batch else 1
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = "cuda"
    _, total = layout(L, C, T, Vp)
    flat = np.fromfile(a.init, dtype=np.float32) if a.init else \
        (np.random.default_rng(0).standard_normal(total) * 0.02).astype(np.float32)
    model = GPT(L, H, C, T, V, Vp, flat).to(dev)
    decay = [p for n, p in model.named_parameters() if model.decay[n]]
    nodecay = [p for n, p in model.named_parameters() if not model.decay[n]]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": nodecay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    step_fn = model if a.no_compile else torch.compile(model)
    paths = glob.glob(a.train)
    assert paths, f"no shard matches {a.train}"
    wins = load_windows(paths, T)
    per_epoch = len(wins) // B
    assert per_epoch > 0, "fewer windows than one batch"
    batch_no = 0
    out = open(a.metrics, "w") if a.metrics else None
    ntok = K * B * T
    torch.cuda.reset_peak_memory_stats()
    t_last, rates, pending = None, [], []
    for step in range(a.steps):
        lr = lr_at(step, a.warmup, a.steps, a.lr, a.lr_final_frac, a.schedule == "cosine")
        for g in opt.param_groups:
            g["lr"] = lr
        loss_sum = 0.0
        for k in range(K):
            first = (batch_no % per_epoch) * B
            batch = wins[first:first + B]
            batch_no += 1
            xy = torch.from_numpy(np.stack(batch).astype(np.int64)).to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step_fn(xy[:, :-1], xy[:, 1:]) / K
            loss.backward()
            loss_sum = loss_sum + loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip if a.clip > 0 else 1e30)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending.append((step, lr, loss_sum.detach(), norm.detach()))
        # no per-step host sync: losses are read every 10 steps (and at the end), when the
        # window's wall time is taken as well -- as a tuned PyTorch loop does
        if (step + 1) % 10 == 0 or step == a.steps - 1:
            vals = torch.stack([torch.stack([l.float(), n.float()]) for _, _, l, n in pending]).tolist()
            t = time.time()
            ms = (t - t_last) * 1e3 / len(pending) if t_last else float("nan")
            if t_last and step >= 10:
                rates.append(ntok / (ms / 1e3))
            t_last = t
            for (s_, lr_, _, _), (lv, nv) in zip(pending, vals):
                rec = {"step": s_ + 1, "loss": lv, "lr": lr_, "grad_norm": nv, "ms": ms,
                       "tok_per_s": ntok / (ms / 1e3) if ms == ms else 0}
                if out:
                    out.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)
            pending = []
    peak = torch.cuda.max_memory_allocated() / 2**30
    reserved = torch.cuda.max_memory_reserved() / 2**30
    # what the device has in use now, as nanograph's init log counts its own: the allocator's
    # pool (kept, never emptied, so its peak) plus the CUDA context and the libraries' handles
    free_b, total_b = torch.cuda.mem_get_info()
    in_use = (total_b - free_b) / 2**30
    mean = sum(rates) / len(rates) if rates else 0
    print(f"peer: {a.model} B={B} T={T} K={K}: {mean:.0f} tok/s (mean of 10-step windows after step 10), "
          f"peak {peak:.1f} GiB allocated, {reserved:.1f} GiB reserved, "
          f"device in use {in_use:.2f} GiB", flush=True)
    if a.save:
        save_hf(model, a.save, L, H, C, T, V)


def save_hf(model, path, L, H, C, T, V):
    """Hugging Face GPT-2 names and layouts (Conv1D weights stored (in, out), wte unpadded),
    written by the safetensors library -- the file another program would hand to nanograph."""
    from safetensors.torch import save_file
    p = {n: t.detach().float().cpu() for n, t in model.named_parameters()}
    out = {"transformer.wte.weight": p["wte"][:V], "transformer.wpe.weight": p["wpe"],
           "transformer.ln_f.weight": p["lnfw"], "transformer.ln_f.bias": p["lnfb"]}
    hf = [("ln_1.weight", "ln1w", False), ("ln_1.bias", "ln1b", False),
          ("attn.c_attn.weight", "qkvw", True), ("attn.c_attn.bias", "qkvb", False),
          ("attn.c_proj.weight", "attprojw", True), ("attn.c_proj.bias", "attprojb", False),
          ("ln_2.weight", "ln2w", False), ("ln_2.bias", "ln2b", False),
          ("mlp.c_fc.weight", "fcw", True), ("mlp.c_fc.bias", "fcb", False),
          ("mlp.c_proj.weight", "fcprojw", True), ("mlp.c_proj.bias", "fcprojb", False)]
    for l in range(L):
        for name, ours, conv1d in hf:
            t = p[ours][l]
            out[f"transformer.h.{l}.{name}"] = t.t() if conv1d else t
    out = {k: v.contiguous() for k, v in out.items()}
    meta = {"format": "pt", "n_layer": str(L), "n_head": str(H), "n_embd": str(C),
            "n_positions": str(T), "vocab_size": str(V), "writer": "tools/peer/gpt_peer.py"}
    save_file(out, path, metadata=meta)
    print(f"peer: wrote {path} ({len(out)} tensors)", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""tools/peer/ref_eval.py - a nanograph speedrun checkpoint validated by the speedrun's reference
code: its model classes and data loader (executed from the reference script itself, up to its
"# int main" line; nothing of it is copied here), the checkpoint's tensors loaded into them
(the embeddings as bf16, as the reference keeps them), and its validation loop over the first
10,485,760 tokens of the val shards, once with its 262,144-token sequences and once with
nanograph's 49,152. It shows whether a difference between the two programs' validation losses
lies in training or in the validation itself. Needs the reference's torch (FlexAttention,
torch.compile) and a GPU.
    python3 tools/peer/ref_eval.py train_gpt.py OUT/model_00000400.safetensors \
        'corpus/val_*.bin' WINDOW_BLOCKS
WINDOW_BLOCKS: the long window in 128-token blocks at the checkpoint's step (14 at the end of a
run). Prints "ref-eval seq S: N sequences, val loss X".
load_flat_into sets the reference's model to export_init's weights instead (`speedrun-race ref
--init-seed`).
"""
import json
import os
import struct
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # speedrun_peer, beside it

VAL_TOKENS = 10485760  # the reference's val_tokens
V, VP, L, H, C = 50257, 50304, 12, 6, 768


def read_safetensors(path):
    """{name: float32 tensor} of a safetensors file (F32 or BF16 tensors)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        data = bytearray(f.read())
    out = {}
    for name, v in hdr.items():
        if name == "__metadata__":
            continue
        a, b = v["data_offsets"]
        dt = {"F32": torch.float32, "BF16": torch.bfloat16}[v["dtype"]]
        out[name] = torch.frombuffer(data[a:b], dtype=dt).reshape(v["shape"]).float()
    return out


def load_into(model, t, C=C, bf16_embeddings=True):
    """nanograph's speedrun tensor names (src/checkpoint.c) into the reference's modules (L
    blocks of width C); its scalars vector is [skip weights (L, the first L/2 used), x lambdas
    (L x 2), value lambdas (L x 2), padding]. The embeddings end as bf16, as the reference keeps
    them, unless bf16_embeddings is false."""
    with torch.no_grad():
        model.embed.weight.zero_()
        model.embed.weight[:V] = t["wte"]
        for k in range(3):
            model.value_embeds[k].weight.zero_()
            model.value_embeds[k].weight[:V] = t["ve.%d" % k]
        sc = model.scalars
        sc[:L // 2] = t["skipw"]
        for l, b in enumerate(model.blocks):
            sc[L + 2 * l: L + 2 * l + 2] = t["blocks.%d.xlambda" % l].reshape(2)
            if b.attn is not None:
                b.attn.qkv_w.copy_(t["blocks.%d.qkvw" % l].reshape(3, C, C))
                b.attn.c_proj.weight.copy_(t["blocks.%d.attprojw" % l])
                sc[3 * L + 2 * l: 3 * L + 2 * l + 2] = t["blocks.%d.vlambda" % l].reshape(2)
            b.mlp.c_fc.weight.copy_(t["blocks.%d.fcw" % l])
            b.mlp.c_proj.weight.copy_(t["blocks.%d.fcprojw" % l])
        model.lm_head.weight.copy_(t["headw"])
    for m in model.modules():
        if bf16_embeddings and isinstance(m, torch.nn.Embedding):
            m.bfloat16()


def flat_tensors(path, C=C, Vp=VP):
    """export_init's flat float32 file of the speedrun family (graph/gpt.h's layout, read through
    speedrun_peer.layout; L blocks of width C, the vocabulary padded to Vp) as {name: tensor}
    under the checkpoint's names, as read_safetensors gives them: wte and ve.<t> their V real
    rows, blocks.<l>.<name> a block's slice."""
    import numpy as np
    import speedrun_peer as sp
    lay, total = sp.layout(L, C, Vp)
    flat = np.fromfile(path, dtype=np.float32)
    if flat.size != total:
        sys.exit("ref_eval: %s has %d floats, the speedrun layout's %d (hint: "
                 "build/tools/export_init speedrun SEED FILE writes it)" % (path, flat.size, total))

    def get(name):
        shape, off = lay[name]
        n = int(np.prod(shape))
        return torch.from_numpy(flat[off:off + n].copy()).reshape(shape)
    t = {"wte": get("wte")[:V], "headw": get("headw"), "skipw": get("skipw")}
    for k in range(sp.N_VE):
        t["ve.%d" % k] = get("ve")[k, :V]
    for name in ("xlambda", "fcw", "fcprojw"):
        for l in range(L):
            t["blocks.%d.%s" % (l, name)] = get(name)[l]
    for name in ("qkvw", "attprojw", "vlambda"):
        for l in range(L):
            if sp.attn_slot(L, l) >= 0:
                t["blocks.%d.%s" % (l, name)] = get(name)[sp.attn_slot(L, l)]
    return t


def load_flat_into(model, path):
    """The reference's model set to nanograph's initial weights (export_init's file): the
    reference trained from the same init as nanograph and the peer, with the same seed."""
    load_into(model, flat_tensors(path))


def main():
    ref, ckpt, val, window = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    src = open(ref).read()
    g = {"__name__": "reference", "__file__": ref}
    sys.argv = [ref]  # the reference reads its own file through sys.argv[0]
    exec(compile(src[:src.index("# int main")], ref, "exec"), g)
    g["world_size"] = 1  # a global of its main section that GPT() reads
    model = g["GPT"](vocab_size=VP, num_layers=L, num_heads=H, model_dim=C,
                     max_seq_len=262144).cuda()
    load_into(model, read_safetensors(ckpt))
    model = torch.compile(model, dynamic=False)
    model.eval()
    wb = torch.tensor(window, dtype=torch.int32).cuda()
    for seq in (262144, 49152):
        t0, steps, total = time.time(), VAL_TOKENS // seq, 0.0
        loader = g["distributed_data_generator"](val, seq, 0, 1)
        with torch.no_grad():
            for _ in range(steps):
                x, y = next(loader)
                total += model(x, y, wb).item()
        print("ref-eval seq %d: %d sequences, val loss %.4f (%.0f s)" %
              (seq, steps, total / steps, time.time() - t0), flush=True)


if __name__ == "__main__":
    main()

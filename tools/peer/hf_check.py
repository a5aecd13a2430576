#!/usr/bin/env python3
"""tools/peer/hf_check.py — does a nanograph checkpoint mean the same model to Hugging Face?

On the GPU machine (transformers installed, offline):
  1. loads our model_*.safetensors into transformers' GPT2LMHeadModel through from_pretrained
     (config.json written from the checkpoint's metadata), checking no tensor is missing or left
     over (lm_head.weight is tied to wte, as in GPT-2);
  2. the validation loss of HF (fp32) on the same windows as `nanograph eval` (file order, B
     windows of T+1 per batch) against ours (bf16 forward on the GPU): equal within bf16 noise;
  3. HF's own save_pretrained safetensors loads back into `nanograph eval` with the same loss;
  4. logits: `nanograph sample --logits` (the KV-cache decode graph, greedy) against HF's
     forward on the same tokens, within 2x the error of HF itself run in bf16 (both vs HF fp32);
  5. greedy continuation: ours against HF generate (do_sample off), reporting how many leading
     tokens agree (bf16 near-ties may split them late).
Prints one JSON line with every number, and exits 1 when a check fails.
"""
import argparse, glob, json, os, struct, subprocess, sys, tempfile

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Tokenizer


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def windows(pattern, B, T, n_batches):
    toks = []
    for p in sorted(glob.glob(pattern)):
        raw = np.fromfile(p, dtype=np.uint8)
        hdr = raw[:1024].view(np.int32)
        assert hdr[0] == 20240520, p
        toks.append(raw[1024:1024 + 2 * int(hdr[2])].view(np.uint16).astype(np.int64))
    out = []
    for t in toks:  # windows overlap by one token and never cross shards
        for w in range((len(t) - 1) // T):
            out.append(t[w * T: w * T + T + 1])
    need = B * n_batches
    assert len(out) >= need, f"{len(out)} windows, need {need}"
    return torch.tensor(np.stack(out[:need])).view(n_batches, B, T + 1)


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"hf_check: {' '.join(cmd)} failed:\n{r.stderr}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nanograph", default="build/nanograph")
    ap.add_argument("--ckpt", required=True, help="model_*.safetensors")
    ap.add_argument("--val", required=True, help="validation shard glob")
    here = os.path.dirname(os.path.abspath(__file__))
    tree_vocab = os.path.join(here, "..", "..", "data", "gpt2")
    ap.add_argument("--vocab", default=os.environ.get("NG_GPT2_DIR", tree_vocab),
                    help="folder of GPT-2's encoder.json and vocab.bpe (default: $NG_GPT2_DIR, "
                    "else the tree's data/gpt2)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--prompt", default="The licensee may")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--loss-tol", type=float, default=2e-2)
    a = ap.parse_args()
    meta = header(a.ckpt)["__metadata__"]
    cfg = GPT2Config(n_layer=int(meta["n_layer"]), n_head=int(meta["n_head"]),
                     n_embd=int(meta["n_embd"]), n_positions=int(meta["n_positions"]),
                     vocab_size=int(meta["vocab_size"]), activation_function="gelu_new",
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                     tie_word_embeddings=True)
    dev = "cuda"
    res = {"ckpt": a.ckpt}
    ok = True
    with tempfile.TemporaryDirectory() as d:
        os.symlink(os.path.abspath(a.ckpt), os.path.join(d, "model.safetensors"))
        cfg.save_pretrained(d)
        model, info = GPT2LMHeadModel.from_pretrained(d, output_loading_info=True)
    missing = [k for k in info["missing_keys"] if not k.endswith((".attn.bias", ".attn.masked_bias"))
               and k != "lm_head.weight"]
    res["missing"], res["unexpected"] = sorted(missing), sorted(info["unexpected_keys"])
    ok &= not missing and not info["unexpected_keys"]
    model = model.to(dev).float().eval()
    res["tied"] = model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    ok &= res["tied"]

    T = cfg.n_positions
    data = windows(a.val, a.batch, T, a.batches).to(dev)
    losses = []
    with torch.no_grad():
        for b in range(a.batches):
            x, y = data[b, :, :-1], data[b, :, 1:]
            logits = model(x).logits.float()
            losses.append(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item())
    res["hf_loss"] = sum(losses) / len(losses)
    ev = ["--val", a.val, "--batch", str(a.batch), "--batches", str(a.batches)]
    ours = json.loads(run([a.nanograph, "eval", "--ckpt", a.ckpt] + ev).strip().splitlines()[-1])
    res["ours_loss"] = ours["val_loss"]
    res["loss_diff"] = abs(res["hf_loss"] - res["ours_loss"])
    ok &= res["loss_diff"] <= a.loss_tol

    with tempfile.TemporaryDirectory() as d:  # HF's own file back into nanograph
        model.save_pretrained(d, safe_serialization=True)
        back = json.loads(run([a.nanograph, "eval", "--ckpt", os.path.join(d, "model.safetensors")]
                              + ev).strip().splitlines()[-1])
    res["hf_saved_loss_ours"] = back["val_loss"]
    ok &= abs(back["val_loss"] - res["ours_loss"]) <= 1e-6

    # 4. logits: our KV-cache decode (`sample --logits`, greedy) against HF on the same tokens.
    # Tolerance as docs/CONTRIBUTING.md derives it: ours within 2x the error of the same model run
    # naively in bf16 (HF with bf16 weights and activations), both against HF in fp32, plus a
    # small atol.
    tok = GPT2Tokenizer(os.path.join(a.vocab, "encoder.json"), os.path.join(a.vocab, "vocab.bpe"))
    ids = tok.encode(a.prompt)
    with tempfile.TemporaryDirectory() as d:
        lf = os.path.join(d, "logits.bin")
        our_text = run([a.nanograph, "sample", "--ckpt", a.ckpt, "--prompt", a.prompt,
                        "--tokens", str(a.tokens), "--temperature", "0", "--vocab", a.vocab,
                        "--logits", lf])
        raw = np.fromfile(lf, dtype=np.uint8)
    n_rows, V, n_seq = (int(x) for x in raw[:12].view(np.int32))
    seq = raw[12:12 + 4 * n_seq].view(np.int32).astype(np.int64)
    ours_rows = torch.from_numpy(raw[12 + 4 * n_seq:].view(np.float32).reshape(n_rows, V).copy())
    assert seq[:len(ids)].tolist() == ids, "the prompt's tokens differ from HF's tokenizer"
    x = torch.tensor(seq[None, :n_rows], device=dev)
    with torch.no_grad():
        hf32 = model(x).logits[0].float().cpu()
        m16 = GPT2LMHeadModel(cfg).to(dev).eval()
        m16.load_state_dict(model.state_dict())
        hf16 = m16.to(torch.bfloat16)(x).logits[0].float().cpu()
    err_ours = (ours_rows - hf32).abs().max().item()
    err_bf16 = (hf16 - hf32).abs().max().item()
    scale = hf32.abs().max().item()
    res["logits_rows"], res["logits_scale"] = n_rows, scale
    res["logits_max_abs_err"], res["logits_bf16_naive_max_abs_err"] = err_ours, err_bf16
    res["logits_rel_l2"] = ((ours_rows - hf32).norm() / hf32.norm()).item()
    res["logits_argmax_agree"] = (ours_rows.argmax(1) == hf32.argmax(1)).float().mean().item()
    ok &= err_ours <= 2 * err_bf16 + 1e-3 * scale

    # 5. greedy continuation: ours (from the logits run: no EOT stop) against HF generate
    with torch.no_grad():
        g = model.generate(torch.tensor([ids], device=dev), max_new_tokens=a.tokens,
                           do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    ours_ids = seq[len(ids):].tolist()
    agree = 0
    while agree < min(len(g), len(ours_ids)) and g[agree] == ours_ids[agree]:
        agree += 1
    res["greedy_agree_tokens"], res["greedy_tokens"] = agree, min(len(g), len(ours_ids))
    res["hf_text"], res["our_text"] = tok.decode(g), our_text[len(a.prompt):].rstrip("\n")
    ok &= agree >= min(8, len(g))
    res["ok"] = bool(ok)
    print(json.dumps(res))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

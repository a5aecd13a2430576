#!/usr/bin/env python3
"""tools/peer/ref_check.py - nanograph's speedrun recipe against the speedrun's own code, in
float64 on the CPU. The reference script (the modded-nanogpt record named in docs/DESIGN.md "The
speedrun model") is executed from its own file, nothing of it copied here: its model classes,
Muon and DistAdam up to its "# int main" line, and from its main section the statements that
build the optimizers (parameter groups, learning rates, betas, eps), its learning-rate and
window schedules and, from its training loop, the statements after the backward that set each
step's learning rates and Muon momentum and step the optimizers. That code trains a
12-block model from export_init's weights on a shard of random tokens (drawn from the first
--alphabet ids, so that the model learns; a document start about every 300), one sequence a step, and `nanograph train --device cpu --optimizer muon` trains the
same model on the same windows; every step's loss is compared.

  python3 tools/peer/ref_check.py SCRIPT [--steps 20] [--seed 1] [--channels 128]
                                  [--heads 1] [--seq 1024] [--alphabet 512] [--tol 1e-5]
                                  [--build build]

The model: 12 blocks (the reference's block masks and value-embedding layout are written for
12), width --channels with --heads heads of 128 (the reference's head size), the GPT-2
vocabulary (its document token 50256), --seq tokens a step.

Float64 on both sides; what the reference runs in lower precision is lifted, by edits of its
text (each checked to apply exactly once, EDITS below): its Newton-Schulz input is not cast to
bf16, its logits and rotary stay in the model's precision (float64 frequencies and positions),
its RMSNorm takes float32's epsilon as its bf16 activations give it on the GPU (float64's
otherwise), its block-mask index tensor is made on the CPU, and its CUDA warm-up at import is
skipped. Its embeddings are not cast to bf16 (that cast is in its main section, not run) and
its head is not FP8 (use_fp8 off: torch._scaled_mm would run it in E4M3 with a bf16 result).
The two should then agree to ~1e-6 in the loss (ours prints 6 digits); a reading of the recipe
that differs (a learning rate, a schedule, a mask) shows as 1e-3 or more within a few steps.
Its torch.compile decorators are disabled (TORCHDYNAMO_DISABLE), its collectives replaced by
one-process equivalents (world size 1: the reduce-scatters copy, the gathers do nothing), and
its flex_attention call computed densely under the same BlockMask (its block lists, clamps
and mask_mod), since FlexAttention has no backward on the CPU.
Needs torch with FlexAttention (2.5 or newer). 30 steps at --seq 512 take ~11 minutes on two
cores, both programs.
"""
import argparse, ast, json, os, subprocess, sys, tempfile, types

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_eval  # noqa: E402
import speedrun_peer as sp  # noqa: E402

L, V, EOT = ref_eval.L, ref_eval.V, 50256  # 12 blocks, the GPT-2 vocabulary

# (what, text in the reference, replacement): the edits applied to its source, each exactly once
EDITS = [("no CUDA warm-up at import",
          'torch.empty(1, device="cuda", requires_grad=True).backward()', "pass"),
         ("Newton-Schulz in the parameters' precision",
          "zeropower_via_newtonschulz5(grad.bfloat16(), 5)", "zeropower_via_newtonschulz5(grad, 5)"),
         ("logits kept in the model's precision",
          "logits = self.lm_head(x).float()", "logits = self.lm_head(x)"),
         ("rotary inputs kept in the model's precision",
          "x1, x2 = x_BTHD.to(dtype=torch.float32).chunk(2, dim=-1)",
          "x1, x2 = x_BTHD.chunk(2, dim=-1)"),
         ("rotary frequencies in float64",
          "angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim//4, dtype=torch.float32)",
          "angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim//4, dtype=torch.float64)"),
         ("rotary positions in float64",
          "t = torch.arange(max_seq_len, dtype=torch.float32)",
          "t = torch.arange(max_seq_len, dtype=torch.float64)"),
         ("RMSNorm's eps as on the GPU (bf16 input: float32's epsilon), not float64's",
          "return F.rms_norm(x, (x.size(-1),))",
          "return F.rms_norm(x, (x.size(-1),), eps=torch.finfo(torch.float32).eps)"),
         ("block-mask indices on the CPU",
          'block_idx = torch.arange(NUM_BLOCKS, dtype=torch.int32, device="cuda")',
          "block_idx = torch.arange(NUM_BLOCKS, dtype=torch.int32, device=input_seq.device)")]


class _Work:
    """What an async collective returns: here always complete."""

    def get_future(self):
        f = torch.futures.Future()
        f.set_result(None)
        return f

    def wait(self):
        return None


def one_process_dist():
    """torch.distributed's calls that the reference's optimizers make, for one process."""
    def reduce_scatter_tensor(out, inp, op=None, async_op=False):
        out.copy_(inp)
        return _Work()

    def reduce_scatter(out, inputs, op=None, async_op=False):
        if inputs[0] is not out:
            out.copy_(inputs[0])
        return _Work()

    def all_gather(outs, inp, async_op=False):
        if outs[0] is not inp:
            outs[0].copy_(inp)
        return _Work()

    def all_gather_into_tensor(out, inp, async_op=False):
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return _Work()
    return types.SimpleNamespace(ReduceOp=types.SimpleNamespace(AVG="avg"),
                                 reduce_scatter_tensor=reduce_scatter_tensor,
                                 reduce_scatter=reduce_scatter, all_gather=all_gather,
                                 all_gather_into_tensor=all_gather_into_tensor)


def dense_flex_attention(q, k, v, block_mask, scale):
    """FlexAttention's result under a BlockMask, computed densely (FlexAttention has no
    backward on the CPU): a key block is seen whole where the mask lists it as full, through
    mask_mod where it lists it as partial, not at all elsewhere (a negative count lists none)."""
    T, bs = q.size(-2), block_mask.BLOCK_SIZE[0]
    idx = torch.arange(T)
    elem = block_mask.mask_mod(0, 0, idx[:, None], idx[None, :])
    seen = torch.zeros(T, T, dtype=torch.bool)
    for nums, inds, whole in ((block_mask.kv_num_blocks, block_mask.kv_indices, False),
                              (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True)):
        for i in range(T // bs):
            rows = slice(i * bs, (i + 1) * bs)
            for j in inds[0, 0, i, :max(int(nums[0, 0, i]), 0)].tolist():
                cols = slice(j * bs, (j + 1) * bs)
                seen[rows, cols] = True if whole else elem[rows, cols]
    s = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1) @ v


def load_reference(path):
    """The reference's namespace: its definitions, then from its main section the optimizer and
    schedule statements; returns (namespace, the training loop's per-step statements)."""
    src = open(path).read()
    for what, old, new in EDITS:
        if src.count(old) != 1:
            sys.exit("ref_check: the reference's text %r occurs %d times, not once (%s): is %s "
                     "the 2025-07-13 record's train_gpt.py?" % (old, src.count(old), what, path))
        src = src.replace(old, new)
    cut = src.index("# int main")
    g = {"__name__": "reference", "__file__": path}
    argv, sys.argv = sys.argv, [path]
    exec(compile(src[:cut], path, "exec"), g)
    sys.argv = argv
    g.update(dist=one_process_dist(), rank=0, world_size=1, flex_attention=dense_flex_attention)
    main = ast.parse(src[cut:]).body
    keep, loop = [], None
    for node in main:
        text = ast.get_source_segment(src[cut:], node)
        if isinstance(node, ast.ClassDef) and node.name == "Hyperparameters":
            keep.append(node)
        elif isinstance(node, ast.FunctionDef) and node.name in ("get_lr", "get_window_size_blocks"):
            keep.append(node)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id in ("args", "hidden_matrix_params", "embed_params",
                                                     "scalar_params", "head_params", "optimizer1",
                                                     "optimizer2", "optimizers")
                for t in node.targets):
            keep.append(node)
        elif isinstance(node, ast.For) and isinstance(node.target, ast.Name) and \
                node.target.id == "step":
            loop = node
        elif isinstance(node, ast.For) and "initial_lr" in text:
            keep.append(node)
    if loop is None:
        sys.exit("ref_check: no `for step in ...` training loop in %s" % path)
    body, started = [], False
    for node in loop.body:
        text = ast.get_source_segment(src[cut:], node)
        if not started:
            started = isinstance(node, ast.Expr) and ".backward()" in text
            continue
        if "approx_training_time_ms" in text:
            break
        body.append(node)
    if not body:
        sys.exit("ref_check: found no optimizer statements after the backward in %s" % path)
    return g, keep, ast.Module(body=body, type_ignores=[])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("script", help="the reference's train_gpt.py")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--channels", type=int, default=128)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--build", default="build")
    ap.add_argument("--alphabet", type=int, default=512, help="tokens drawn from 0..N-1 (and "
                    "the document token): a model that learns, as on text")
    ap.add_argument("--tol", type=float, default=1e-5, help="largest relative loss difference "
                    "(ours prints 6 significant digits: up to 5e-6 from the rounding alone)")
    a = ap.parse_args()
    if a.channels != 128 * a.heads or a.seq % 128:
        sys.exit("ref_check: --channels must be 128 x --heads (the reference's head size) and "
                 "--seq a multiple of 128")
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)  # the reference's constructor draws weights that load_init replaces
    C, T, N = a.channels, a.seq, a.steps
    Vp = sp.padded_vocab(V)
    shape = ["--layers", str(L), "--heads", str(a.heads), "--channels", str(C), "--vocab",
             str(V), "--seq-len", str(T)]
    for f, hint in ((a.script, "the record's train_gpt.py (docs/DESIGN.md \"The speedrun model\")"),
                    (os.path.join(a.build, "nanograph"), "--build: a build directory"),
                    (os.path.join(a.build, "tools", "export_init"), "--build: a build directory")):
        if not os.path.exists(f):
            sys.exit("ref_check: no %s (hint: %s)" % (f, hint))
    g, setup, per_step = load_reference(a.script)
    with tempfile.TemporaryDirectory() as d:
        init, shard = os.path.join(d, "init.bin"), os.path.join(d, "train_000000.bin")
        subprocess.run([os.path.join(a.build, "tools", "export_init"), "speedrun-tiny",
                        str(a.seed), init] + shape, check=True, stdout=subprocess.DEVNULL)
        rng = np.random.default_rng(a.seed)
        n = N * T + 1
        tok = np.where(rng.integers(0, 300, n) == 0, EOT, rng.integers(0, a.alphabet, n))
        with open(shard, "wb") as f:
            f.write(np.array([20240520, 1, n] + [0] * 253, dtype=np.int32).tobytes())
            f.write(tok.astype(np.uint16).tobytes())
        metrics = os.path.join(d, "m.jsonl")
        cmd = [os.path.join(a.build, "nanograph"), "train", "--device", "cpu", "--model",
               "speedrun-tiny"] + shape + ["--batch", "1", "--optimizer", "muon", "--steps",
                                           str(N), "--seed", str(a.seed), "--train", shard,
                                           "--no-shuffle", "--metrics", metrics]
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            last = r.stderr.strip().splitlines()[-1:] or ["exit status %d" % r.returncode]
            sys.exit("ref_check: nanograph train failed: %s" % last[0])
        ours = [json.loads(l)["loss"] for l in open(metrics) if '"loss"' in l]
        t = ref_eval.flat_tensors(init, C, Vp)

    model = g["GPT"](vocab_size=Vp, num_layers=L, num_heads=a.heads, model_dim=C,
                     max_seq_len=T).double()
    ref_eval.load_into(model, t, C, bf16_embeddings=False)
    model.lm_head.use_fp8 = False  # its FP8 head (torch._scaled_mm) runs on a CPU too: float64
    g["model"] = model
    exec(compile(ast.Module(body=setup, type_ignores=[]), a.script, "exec"), g)
    g["args"].num_iterations = N
    g["get_window_size_blocks_helper"] = lambda w: torch.tensor(w // 128, dtype=torch.int32)
    code = compile(per_step, a.script, "exec")
    tokens = torch.from_numpy(tok.astype(np.int64))
    worst = 0.0
    for step in range(N):
        x, y = tokens[step * T: step * T + T], tokens[step * T + 1: step * T + T + 1]
        loss = model(x, y, g["get_window_size_blocks"](step))
        loss.backward()
        g["step"] = step
        exec(code, g)
        mean = loss.item() / T
        rel = abs(ours[step] - mean) / mean if step < len(ours) else float("inf")
        worst = max(worst, rel)
        print("ref-check step %d W %d loss ours %.6f reference %.9f rel diff %.2e" %
              (step + 1, int(g["get_window_size_blocks"](step)), ours[step] if step < len(ours)
               else float("nan"), mean, rel), flush=True)
    good = worst <= a.tol and len(ours) == N
    print("ref-check: %s, largest relative loss difference %.2e over %d steps (tolerance %g)" %
          ("PASS" if good else "FAIL", worst, N, a.tol))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())

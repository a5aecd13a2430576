"""tools/peer/steptime.py - what gpt_peer.py and nanogpt_ref.py share, so that the two PyTorch
programs are sized, fed, timed and summed up the same way (tools/bench compares both with
nanograph): the model presets, the trip of a token batch to the device, the 10-step window
meter and the closing summary line.

Timing. Nothing on the device is read back per step: each step's loss and gradient norm stay
device tensors until the end of a window of WINDOW steps, when all of them are read in one host
sync and the wall clock is taken. A window's rate is its tokens over the time since the previous
window's sync; the speed is the mean of the rates of the windows after step WINDOW (steps 11-20,
21-30, ...: step 1 compiles, the first window warms up), as tools/bench counts nanograph's own
log. STEPS >= 2 * WINDOW gives a figure.
"""
import json, time

import numpy as np
import torch

# name: (layers, heads, channels, sequence length, vocabulary) -- graph/gpt.c's presets
PRESETS = {"tiny": (2, 2, 64, 64, 512), "d12": (12, 12, 768, 1024, 50257),
           "d24": (24, 16, 1024, 1024, 50257), "d36": (36, 20, 1280, 1024, 50257),
           "d48": (48, 25, 1600, 1024, 50257)}
WINDOW = 10


def padded_vocab(V):
    """graph/gpt.c: Vp = V rounded up to a multiple of 128 (50257 -> 50304)."""
    return (V + 127) // 128 * 128


def to_device(tokens, dev):
    """(B, T+1) integer array -> int64 tensor on dev. On a GPU through pinned memory with a
    non-blocking copy (the caching host allocator keeps each pinned block until its copy has
    run), so the host can queue the step while the device still runs the previous one."""
    t = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
    if dev.type == "cuda":
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)


class Meter:
    """Per-step records, read back and timed every WINDOW steps (see the module's docstring).
    Each record is written to `out` (a JSON line per step) when given; the last record of each
    window is printed, and the first window's wall time (torch.compile's included)."""

    def __init__(self, who, steps, ntok, out=None):
        self.who, self.steps, self.ntok, self.out = who, steps, ntok, out
        self.t_last, self.rates, self.pending = None, [], []
        self.t0 = time.perf_counter()

    def step(self, step, lr, loss, norm):
        """step: 0-based; loss, norm: device tensors (not read here)."""
        self.pending.append((step, lr, loss.detach(), norm.detach()))
        if (step + 1) % WINDOW and step != self.steps - 1:
            return
        self._write(step)

    def flush(self):
        """Read back, time and write the records of a window cut short (before a validation)."""
        if self.pending:
            self._write(self.pending[-1][0])

    def restart_clock(self):
        """The next records' time counts from now (after a validation)."""
        self.t_last = time.perf_counter()

    def _write(self, step):
        vals = torch.stack([torch.stack([l.float(), n.float()])
                            for _, _, l, n in self.pending]).tolist()
        t = time.perf_counter()
        ms = (t - self.t_last) * 1e3 / len(self.pending) if self.t_last else float("nan")
        if self.t_last and step >= WINDOW:
            self.rates.append(self.ntok / (ms / 1e3))
        if not self.t_last:
            print(f"{self.who}: the first {step + 1} steps (compile and warm-up) took "
                  f"{t - self.t0:.1f} s", flush=True)
        self.t_last = t
        rec = None
        for (s_, lr_, _, _), (lv, nv) in zip(self.pending, vals):
            rec = {"step": s_ + 1, "loss": lv, "lr": lr_, "grad_norm": nv, "ms": ms,
                   "tok_per_s": self.ntok / (ms / 1e3) if ms == ms else 0}
            if self.out:
                self.out.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)
        self.pending = []

    def tok_per_s(self):
        return sum(self.rates) / len(self.rates) if self.rates else 0


def summary(who, model, B, T, K, meter, dev):
    """The closing line tools/bench reads (one line, fixed words):
    WHO: MODEL B=.. T=.. K=..: N tok/s (...), peak X GiB allocated, Y GiB reserved,
    device in use Z GiB
    Memory: the allocator's peak (allocated and reserved, from the last reset_peak_memory_stats)
    and what the device has in use at the end -- the allocator's pool (never emptied, so its
    peak) plus the CUDA context and the libraries' handles, as nanograph counts its own."""
    peak = reserved = in_use = 0.0
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) / 2**30
        reserved = torch.cuda.max_memory_reserved(dev) / 2**30
        free_b, total_b = torch.cuda.mem_get_info(dev)
        in_use = (total_b - free_b) / 2**30
    return (f"{who}: {model} B={B} T={T} K={K}: {meter.tok_per_s():.0f} tok/s (mean of "
            f"{WINDOW}-step windows after step {WINDOW}), peak {peak:.1f} GiB allocated, "
            f"{reserved:.1f} GiB reserved, device in use {in_use:.2f} GiB")

#!/usr/bin/env bash
# tools/multi_gpu.sh [STEPS] — on a machine with 2 GPUs: the data-parallel checks.
#   1. tests/test_dist (NCCL collectives between two forked ranks, and a one-rank communicator);
#   2. d12, synthetic corpus, the same 64*2*1024 tokens per step three ways:
#      1 GPU B=64 K=2 through the NCCL path (--world 1), 2 GPUs B=64 each (--world 2, the file
#      bootstrap, or mpirun when it exists), 2 GPUs with --zero1;
#   3. the throughput baseline: 1 GPU B=64 K=1 (no NCCL).
# Prints the loss-curve differences against the 1-GPU run and the tokens/s ratio; logs and
# metrics under $OUT (default ./multi-gpu-out). NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
# RUNS picks the parts (default "test w1_k2 w2 w2_zero1 w0"; also w2_nooverlap: --no-overlap,
# w2_mpi: the same run launched by mpirun; w2_slurm: srun's environment by hand; w2_resume: 2 GPUs, --deterministic, 40 steps straight
# against 20 steps + checkpoint + --resume to 40, losses compared bit for bit; w2_resume_zero1: the
# same with --zero1; w2_signal: SIGTERM to one rank of a ZeRO-1 run, both stop at one step, resume;
# w2_fp8: 2 GPUs with --fp8 --zero1; muon: d12 with --optimizer muon, 1 GPU K=2 against 2 GPUs,
# whose ranks divide the Newton-Schulz work and all-gather it; spr: the speedrun model, one
# sequence of 49,152 tokens a rank, the same two ways).
set -uo pipefail
steps=${1:-60}
run_limit=${RUN_LIMIT:-300} # seconds a two-rank run may take: a hang is reported, not waited out
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ] && [ "$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)" -lt 2 ]; then
  echo "tools/multi_gpu.sh: CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' shows fewer than 2 GPUs" \
    "(two ranks on one GPU hang in NCCL); unset it or list two" >&2
  exit 2
fi
out=${OUT:-multi-gpu-out}
build=${BUILD:-build}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
common=(--model d12 --batch 64 --steps "$steps" --seed 1337 --val-batches 0 --log-every 10)
ng=$build/nanograph
runs=" ${RUNS:-test w1_k2 w2 w2_zero1 w0} "
want() { [[ $runs == *" $1 "* ]]; }

if want test; then
  echo "== test_dist" | tee "$out/summary.txt"
  "$build"/tests/test_dist >"$out/test_dist.log" 2>&1
  tail -1 "$out/test_dist.log" | tee -a "$out/summary.txt"
fi

# 1 GPU, K=2, one-rank NCCL communicator
want w1_k2 && { $ng train "${common[@]}" --total-batch $((64 * 2 * 1024)) --world 1 \
  --metrics "$out/w1_k2.jsonl" >"$out/w1_k2.log" 2>&1 || echo "w1_k2 failed (rc $?)" | tee -a "$out/summary.txt"; }

# 2 GPUs: two processes, one per GPU (file rendezvous), or mpirun when there is one
two_ranks() { # NAME EXTRA-FLAGS...
  local name=$1; shift
  local f=$out/$name.nccl-id
  rm -f "$f"
  if [ "$name" = w2_mpi ]; then
    timeout 35 mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH $ng \
      train "${common[@]}" "$@" --metrics "$out/$name.jsonl" >"$out/$name.log" 2>&1 ||
      echo "$name failed (rc $?)" | tee -a "$out/summary.txt"
    return
  fi
  timeout "$run_limit" $ng train "${common[@]}" "$@" --world 2 --rank 1 --dist-file "$f" \
    >"$out/$name.rank1.log" 2>&1 &
  local p1=$!
  timeout "$run_limit" $ng train "${common[@]}" "$@" --world 2 --rank 0 --dist-file "$f" \
    --metrics "$out/$name.jsonl" >"$out/$name.log" 2>&1
  local rc=$?
  wait $p1 || rc=$?
  [ $rc = 0 ] || echo "$name failed (rc $rc)" | tee -a "$out/summary.txt"
}
want w2 && two_ranks w2
want w2_zero1 && two_ranks w2_zero1 --zero1
want w2_nooverlap && two_ranks w2_nooverlap --no-overlap
want w2_fp8 && two_ranks w2_fp8 --fp8 --zero1

# Muon with ranks: each orthogonalises its share of every group's matrices and the results are
# all-gathered inside the graph; the same tokens a step on 1 GPU (K=2) give the reference run
if want muon; then
  $ng train "${common[@]}" --optimizer muon --total-batch $((64 * 2 * 1024)) --world 1 \
    --metrics "$out/w1_k2_muon.jsonl" >"$out/w1_k2_muon.log" 2>&1 ||
    echo "w1_k2_muon failed (rc $?)" | tee -a "$out/summary.txt"
  two_ranks w2_muon --optimizer muon
fi
if want spr; then
  rc_common=("${common[@]}")
  common=(--model speedrun --steps "$steps" --seed 1337 --val-batches 0 --log-every 10)
  $ng train "${common[@]}" --total-batch $((2 * 49152)) --world 1 \
    --metrics "$out/w1_k2_spr.jsonl" >"$out/w1_k2_spr.log" 2>&1 ||
    echo "w1_k2_spr failed (rc $?)" | tee -a "$out/summary.txt"
  two_ranks w2_spr
  common=("${rc_common[@]}")
fi

# throughput baseline: 1 GPU, B=64, plain path
want w0 && { $ng train "${common[@]}" --metrics "$out/w0.jsonl" >"$out/w0.log" 2>&1 || echo "w0 failed" | tee -a "$out/summary.txt"; }
want w2_mpi && command -v mpirun >/dev/null && two_ranks w2_mpi

# srun's environment set by hand (no Slurm here): the bootstrap path `srun nanograph train`
# takes -- SLURM_STEP_NUM_TASKS/PROCID/LOCALID/JOB_ID/STEP_ID, no --world/--rank flags
if want w2_slurm; then
  rm -f nanograph-nccl-77.0
  env SLURM_STEP_NUM_TASKS=2 SLURM_PROCID=1 SLURM_LOCALID=1 SLURM_JOB_ID=77 SLURM_STEP_ID=0 \
    $ng train "${common[@]}" --steps 20 >"$out/w2_slurm.rank1.log" 2>&1 &
  p1=$!
  env SLURM_STEP_NUM_TASKS=2 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_JOB_ID=77 SLURM_STEP_ID=0 \
    $ng train "${common[@]}" --steps 20 --metrics "$out/w2_slurm.jsonl" >"$out/w2_slurm.log" 2>&1
  rc=$?; wait $p1 || rc=$?
  echo "w2_slurm: rc $rc | $(grep -h -i -E 'rank|world|slurm' "$out/w2_slurm.log" | head -2 | tr '\n' ' ')| $(grep -h 'done:' "$out/w2_slurm.log")" | tee -a "$out/summary.txt"
fi

# checkpoint + resume on the same world size: one straight run, one stopped after step 20
# (rank 0 writes the checkpoint) and resumed; both --deterministic, d12 B=16 per GPU.
# w2_resume_zero1: the same with --zero1 (the moments gathered into rank 0's file, resharded).
resume_check() { # NAME EXTRA-FLAGS...
  local name=$1; shift
  local rc_common=("${common[@]}")
  common=(--model d12 --batch 16 --steps 40 --seed 1337 --val-batches 0 --log-every 5 --deterministic "$@")
  rm -rf "$out/ck_$name"_full "$out/ck_$name"_part
  two_ranks "${name}_full" --out "$out/ck_${name}_full"
  two_ranks "${name}_part" --out "$out/ck_${name}_part" --stop-after 20
  ls -la "$out/ck_${name}_part" >"$out/${name}_part.files" 2>&1
  two_ranks "${name}_resumed" --out "$out/ck_${name}_part" --resume
  common=("${rc_common[@]}")
  python3 - "$out" "$name" <<'PY' | tee -a "$out/summary.txt"
import json, os, sys
out, name = sys.argv[1], sys.argv[2]
def load(n):
    p = os.path.join(out, n + ".jsonl")
    return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if "loss" in r} if os.path.exists(p) else {}
full, part, res = load(name + "_full"), load(name + "_part"), load(name + "_resumed")
steps = sorted(s for s in res if s in full)
same = [s for s in steps if res[s] == full[s]]
print(f"{name}: straight run {len(full)} steps; stopped run {len(part)} steps (last {max(part) if part else None}); "
      f"resumed run steps {min(res) if res else None}..{max(res) if res else None}; "
      f"bit-identical losses {len(same)}/{len(steps)}; "
      f"max |dloss| {max((abs(res[s] - full[s]) for s in steps), default=float('nan')):.3g}")
PY
  grep -h -i -E "checkpoint|resum|wrote|error" "$out/${name}"_part*.log "$out/${name}"_resumed*.log | head -20 | tee -a "$out/summary.txt"
  cat "$out/${name}_part.files" | tee -a "$out/summary.txt"
}
# SIGTERM to rank 1 only (a signal reaches the ranks at different steps): both ranks must stop
# after the same step, rank 0 writes the checkpoint (ZeRO-1: gathered from both), and --resume
# continues from it
if want w2_signal; then
  rc_common=("${common[@]}")
  common=(--model d12 --batch 16 --steps 3000 --seed 1337 --val-batches 0 --log-every 1 --zero1)
  rm -rf "$out/ck_sig"; rm -f "$out/w2_signal.nccl-id" "$out/w2_signal.jsonl"
  f=$out/w2_signal.nccl-id
  $ng train "${common[@]}" --out "$out/ck_sig" --world 2 --rank 1 --dist-file "$f" >"$out/w2_signal.rank1.log" 2>&1 &
  p1=$!
  $ng train "${common[@]}" --out "$out/ck_sig" --world 2 --rank 0 --dist-file "$f" \
    --metrics "$out/w2_signal.jsonl" >"$out/w2_signal.log" 2>&1 &
  p0=$!
  for i in $(seq 1 120); do [ "$(wc -l <"$out/w2_signal.jsonl" 2>/dev/null || echo 0)" -ge 40 ] && break; sleep 0.5; done
  kill -TERM $p1
  timeout 60 tail --pid=$p0 -f /dev/null; timeout 10 tail --pid=$p1 -f /dev/null
  wait $p0; r0=$?; wait $p1; r1=$?
  echo "w2_signal: rc rank0 $r0 rank1 $r1 | rank0: $(grep -h -E 'stopped|checkpoint' "$out/w2_signal.log" | tr '\n' ' ')| rank1: $(grep -h -E 'stopped' "$out/w2_signal.rank1.log")" | tee -a "$out/summary.txt"
  n=$(grep -o 'stopped after step [0-9]*' "$out/w2_signal.log" | grep -o '[0-9]*$')
  if [ -n "$n" ]; then
    common=(--model d12 --batch 16 --steps $((n + 10)) --seed 1337 --val-batches 0 --log-every 1 --zero1)
    two_ranks w2_signal_resumed --out "$out/ck_sig" --resume
    echo "w2_signal resumed: $(grep -h -E 'resume:|done:' "$out/w2_signal_resumed.log" | tr '\n' ' ')" | tee -a "$out/summary.txt"
  fi
  common=("${rc_common[@]}")
fi

want w2_resume && resume_check w2_resume
want w2_resume_zero1 && resume_check w2_resume_zero1 --zero1
want w2_resume_fp8 && resume_check w2_resume_fp8 --fp8

python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import json, sys, os
out = sys.argv[1]
def load(n):
    p = os.path.join(out, n + ".jsonl")
    if not os.path.exists(p):
        return {}
    return {r["step"]: r for r in map(json.loads, open(p)) if "loss" in r}
ref, base = load("w1_k2") or load("ref_w1_k2"), load("w0")
def mean_tok(r):
    v = [x["tok_per_s"] for s, x in r.items() if s > 5]
    return sum(v) / len(v) if v else float("nan")
print("runs: w1_k2 = 1 GPU B=64 K=2 --world 1 | w2 = 2 GPUs B=64 | w2_zero1 = + --zero1 | w0 = 1 GPU B=64 K=1")
# each two-rank run against the one-GPU run of the same recipe and tokens a step
refs = {"w2_muon": load("w1_k2_muon"), "w2_spr": load("w1_k2_spr")}
for n in ("w1_k2", "w2", "w2_zero1", "w2_nooverlap", "w2_mpi", "w2_fp8", "w1_k2_muon", "w2_muon",
          "w1_k2_spr", "w2_spr", "w0"):
    r = load(n)
    if not r:
        print(f"{n}: no metrics"); continue
    last = max(r)
    line = f"{n}: steps {len(r)} loss {r[1]['loss']:.4f} -> {r[last]['loss']:.4f} | mean tok/s (steps>5) {mean_tok(r):.0f}"
    against = refs.get(n, ref)
    if n.startswith("w2") and against:
        d = [abs(r[s]["loss"] - against[s]["loss"]) for s in r if s in against]
        dn = [abs(r[s]["grad_norm"] - against[s]["grad_norm"]) / against[s]["grad_norm"]
              for s in r if s in against and against[s]["grad_norm"]]
        line += (f" | vs {'w1_k2' + n[2:] if n in refs else 'w1_k2'}: mean |dloss| "
                 f"{sum(d)/len(d):.5f} max {max(d):.5f} (last {d[-1]:.5f}), max rel dnorm "
                 f"{max(dn, default=float('nan')):.4f}")
    print(line)
for n in ("w2", "w2_nooverlap", "w2_zero1", "w2_mpi", "w2_fp8"):
    if base and load(n):
        print(f"speedup {n} (2 GPUs, B=64 each) / w0 (1 GPU, B=64): {mean_tok(load(n)) / mean_tok(base):.3f}x")
PY

#!/usr/bin/env bash
# tools/parity.sh SHARD_DIR [STEPS] — on the GPU machine: nanograph and the PyTorch peer train
# d12 (B=64, T=1024) from the same initial weights on the same shards in the same order, side
# by side; prints both speeds and peak memories, the mean |loss difference|, and writes
# $OUT/parity.png, $OUT/nanograph.jsonl, $OUT/peer.jsonl (OUT defaults to ./parity-out).
set -euo pipefail
shards=${1:?usage: tools/parity.sh SHARD_DIR [STEPS]}
steps=${2:-300}
out=${OUT:-parity-out}
mkdir -p "$out"
build=${BUILD:-build}
"$build"/tools/export_init d12 1337 /tmp/ng_init_d12.bin
"$build"/nanograph train --model d12 --batch 64 --steps "$steps" --seed 1337 --no-shuffle \
  --train "$shards/train_*.bin" --val-batches 0 --metrics "$out/nanograph.jsonl" \
  2>&1 | tee "$out/nanograph.log" | grep -E "gpu:|step +(1|10|100|200|300)/|done" || true
PYTHONUNBUFFERED=1 python3 tools/peer/gpt_peer.py --model d12 --init /tmp/ng_init_d12.bin \
  --train "$shards/train_*.bin" --batch 64 --steps "$steps" --metrics "$out/peer.jsonl" \
  2>&1 | tee "$out/peer.log" | grep -vE "^\{" || true
python3 tools/peer/compare.py "$out/nanograph.jsonl" "$out/peer.jsonl" "$out/parity.png"

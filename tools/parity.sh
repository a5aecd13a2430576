#!/usr/bin/env bash
# tools/parity.sh SHARD_DIR [STEPS] — on the GPU machine: nanograph and the PyTorch peer train
# one model (MODEL, default d12; T=1024) from the same initial weights on the same shards in the
# same order, side by side; prints both speeds and peak memories, the mean |loss difference|,
# and writes $OUT/parity.png, $OUT/nanograph.jsonl, $OUT/peer.jsonl (OUT defaults to
# ./parity-out). Env: MODEL (d12, d24, d48), BATCH (64, 32, 16 by model), NG_FLAGS (extra
# nanograph train flags, e.g. d24's memory options), BUILD (build).
set -euo pipefail
shards=${1:?usage: tools/parity.sh SHARD_DIR [STEPS]}
steps=${2:-300}
out=${OUT:-parity-out}
mkdir -p "$out"
build=${BUILD:-build}
model=${MODEL:-d12}
case "$model" in
  d12) batch=${BATCH:-64} ;;
  d24) batch=${BATCH:-32} ;;
  d48) batch=${BATCH:-16} ;;
  *) echo "tools/parity.sh: unknown MODEL '$model' (hint: d12, d24 or d48)" >&2; exit 2 ;;
esac
init=$(mktemp /tmp/ng_init_"$model".XXXXXX.bin)
trap 'rm -f "$init"' EXIT
"$build"/tools/export_init "$model" 1337 "$init"
# shellcheck disable=SC2086 # NG_FLAGS is a list of flags
"$build"/nanograph train --model "$model" --batch "$batch" --steps "$steps" --seed 1337 \
  --no-shuffle --train "$shards/train_*.bin" --val-batches 0 --metrics "$out/nanograph.jsonl" \
  ${NG_FLAGS:-} 2>&1 | tee "$out/nanograph.log" | grep -E "gpu:|step +(1|10|100|200|300)/|done" || true
PYTHONUNBUFFERED=1 python3 tools/peer/gpt_peer.py --model "$model" --init "$init" \
  --train "$shards/train_*.bin" --batch "$batch" --steps "$steps" --metrics "$out/peer.jsonl" \
  2>&1 | tee "$out/peer.log" | grep -vE "^\{" || true
python3 tools/peer/compare.py "$out/nanograph.jsonl" "$out/peer.jsonl" "$out/parity.png" "$model"

#!/usr/bin/env bash
# Units larger than the ring on the GPU machine (issue 8, capability 1), and batch throughput (issue 9,
# capability 4), in one command: the CUDA tests, then a Llama-3-70B-shaped bf16 checkpoint (real layer
# shapes and vocabulary, layers cut to fit the disk: every layer 1.71 GB, embedding and head 2.10 GB each)
# streamed with ring_gb=1 from a warm page cache — every layer and the head are read through the ring in
# pieces — its greedy tokens compared with stock transformers on the same GPU; then batch 1 against
# batch 32 on the same model, alternating. Results go to $OUT.
#   L70=6 REPS=2 SKIP_TESTS=0 bash benchmarks/gpu_big_units_check.sh
source "$(dirname "$0")/gpu_common.sh"
cuda_tests
L=${L70:-6}
G="$CACHE/llama3-70b-bf16-L$L"
$PY benchmarks/make_checkpoint.py --arch llama3-70b --dtype bf16 --layers "$L" --quiet "$G" 2>&1 | tail -1
cat "$G"/*.safetensors > /dev/null  # warm the page cache
R="$OUT/big_units.jsonl"
for gpu in 0 8; do
  timeout 300 $PY benchmarks/stream_run.py "$G" --out "$R" --label "llama70-L$L-ring1-gpu$gpu" --ring-gb 1 \
    --gpu-gb $gpu --new-tokens 8 2>&1 | grep -v "Loading weights" | tail -1 | cut -c1-300
done
# stock transformers on the same GPU, same prompt (stream_run's: seed 0, 16 ids in [100, 30000))
timeout 300 $PY - "$G" "$R" <<'PY' 2>&1 | grep -v "Loading weights" | tail -3
import json, sys, torch, transformers
torch.manual_seed(0)
ids = torch.randint(100, 30000, (1, 16), device="cuda")
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="cuda", dtype=torch.bfloat16).eval()
with torch.no_grad():
    out = m.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
want = out[0, 16:].tolist()
rows = [json.loads(x) for x in open(sys.argv[2])]
for r in rows:
    print(r["label"], "tokens equal stock:", r["tokens_out"] == want, r["tokens_out"], want)
json.dump({"stock_tokens": want, "equal": {r["label"]: r["tokens_out"] == want for r in rows}},
          open(sys.argv[2].replace(".jsonl", "_stock.json"), "w"))
PY
B="$OUT/batch.jsonl"
for i in $(seq 1 "${REPS:-2}"); do
  for b in 1 32; do
    timeout 300 $PY benchmarks/stream_run.py "$G" --out "$B" --label "llama70-L$L-batch$b-$i" --ring-gb 1 --gpu-gb 0 \
      --batch $b --new-tokens 8 2>&1 | grep -v "Loading weights" | tail -1 | cut -c1-300
  done
done

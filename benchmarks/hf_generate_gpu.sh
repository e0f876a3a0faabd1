#!/bin/bash
# One-off CUDA check on a lent GPU machine (results/hf_generate/README.md): benchmarks/hf_generate.py on the
# long task's model and a random 150 M one, and two short RL jobs. Run from the repository root; writes to $OUT.
pip install -q --no-index --no-deps --target .site .whl/*.whl > $OUT/pip.log 2>&1
export PYTHONPATH=$PWD/.site:$PWD/src OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 - <<'PY'
import json, shutil, os
src = "runs/sft_long/hf"; dst = "runs/big/hf"
os.makedirs(dst, exist_ok=True)
for f in os.listdir(src):
    if not f.endswith(".safetensors") and f != "config.json":
        shutil.copy(os.path.join(src, f), dst)
from transformers import AutoConfig, AutoModelForCausalLM
c = AutoConfig.from_pretrained(src)
c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads = 1024, 12, 16, 8
c.head_dim, c.intermediate_size, c.max_position_embeddings = 64, 3072, 256
c.layer_types = ["full_attention"] * 12
AutoModelForCausalLM.from_config(c).save_pretrained(dst)
PY
for spec in "runs/sft_long/hf 64" "runs/sft_long/hf 512" "runs/big/hf 64" "runs/big/hf 256"; do
  set -- $spec; S=$SECONDS
  timeout 120 python3 benchmarks/hf_generate.py --model-path $1 --rows $2 --repeats 3 2>&1 | grep -v Loading > $OUT/hfgen_$(basename $(dirname $1))_$2.txt; echo "rc=$? s=$((SECONDS-S))" >> $OUT/hfgen_$(basename $(dirname $1))_$2.txt
done
S=$SECONDS
timeout 100 python3 -m shardwise.cli rl examples/grpo_long.yaml --nproc 1 rl.backend=local train.max_steps=6 run.dir=$OUT/grpo_long checkpoint.export_hf=false > $OUT/rl_long.txt 2>&1; echo "rc=$? s=$((SECONDS-S))" >> $OUT/rl_long.txt
S=$SECONDS
timeout 100 python3 -m shardwise.cli rl examples/grpo_tools.yaml --nproc 1 rl.backend=local train.max_steps=3 run.dir=$OUT/grpo_tools checkpoint.export_hf=false > $OUT/rl_tools.txt 2>&1; echo "rc=$? s=$((SECONDS-S))" >> $OUT/rl_tools.txt
rm -rf $OUT/grpo_*/checkpoints
for f in $OUT/*.txt; do echo "== $f"; tail -12 $f; done

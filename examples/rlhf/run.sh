#!/usr/bin/env bash
# The RLHF pipeline of examples/rlhf/README.md: SFT -> reward model -> GRPO with the learned
# reward. NPROC processes (default 2); a runs/rlhf/sft/hf already there is reused.
set -euo pipefail
NPROC=${NPROC:-2}
SHARDWISE=${SHARDWISE:-shardwise}
cd "$(dirname "$0")/../.."
if [ ! -f runs/rlhf/sft/hf/config.json ]; then
  $SHARDWISE train examples/rlhf/sft.yaml --nproc "$NPROC"
fi
"${PYTHON:-python}" examples/rlhf/make_pairs.py runs/rlhf
rm -rf runs/rlhf/rm runs/rlhf/grpo
$SHARDWISE train examples/rlhf/reward_model.yaml --nproc "$NPROC"
$SHARDWISE rl examples/rlhf/grpo.yaml --nproc "$NPROC"

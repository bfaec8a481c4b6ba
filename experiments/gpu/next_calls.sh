#!/usr/bin/env bash
# The rows issues 38-40 still lack, as two device calls of about six minutes each (a session lends 15 minutes in
# all, machine starts included). Each part is one first_contact.sh invocation with its own results folder
# ($OUT/<part>) and its own time limits, so a part that overruns costs its own rows only; each results folder is packed
# as <part>.tgz beside it (a call returns a limited number of files).
#
#   bash experiments/gpu/next_calls.sh A        # on the GPU machine (after `make gpu-wheels` here; carry .whl and
#   bash experiments/gpu/next_calls.sh B        # .baseline, made by the line below)
#   PYTHON=.venv/bin/python bash experiments/gpu/next_calls.sh A --dry-run    # CPU: the same parts on tiny rows
#
# .baseline: `mkdir -p .baseline && git archive 9a55de8 ulysses_jax | tar -x -C .baseline`, the package measured on
# 2026-11-28 (before the fused loss, the float8 GEMMs writing bf16 and cuDNN's causal mask alone for one document a
# row): the before of those untimed changes, on the same flags, in the same call.
#
# A: llama3.2-1b full at 32K (before/after; ours bf16 and float8 beside transformers and transformers + Liger), then
#    llama3.1-8b LoRA r16 at 8K (bf16 and float8 beside Liger; the float8 before/after).
# B: the small hybrid (Qwen3.5-0.8B shapes at 8K, both delta walks) beside transformers' Qwen3_5ForCausalLM, the GPU
#    tests that have not run yet, llama3.1-8b LoRA r16 at 32K beside Liger, then the delta rule alone at 32K.
# C, D (a later session): llama3.2-1b at 8K beside both peers and at 128K beside Liger; llama3.1-8b LoRA at 64K beside
#    Liger, and packed rows (4 documents a row) beside transformers on flex attention and Liger.
# E: issue 40's loss goal: llama3.2-1b, 200 steps of 2 x 4096 tokens of the built-in corpus, without and with --fp8
#    (float8 within 1% of bf16 at the end; on CPUs the tiny preset parted by 1.7-2.1%, a 256-wide float32 model).
set -u
cd "$(dirname "$0")/../.."
CALL=${1:?usage: next_calls.sh A|B|C|D|E [--dry-run]}
DRY=${2:-}
O=${OUT:-$PWD/runs/next_calls}
S="--steps 3 --warmup 1"
ONE="--attn-max-documents 1"  # one document a row: cuDNN's causal mask alone (the rows below hold one each)
SAVE1="SAVE $ONE"
KEEP1="KEEP $ONE"

part() {  # part NAME VAR=VALUE...: one first_contact.sh invocation into $O/NAME, packed as $O/NAME.tgz
  local name=$1
  shift
  env OUT="$O/$name" "$@" bash experiments/gpu/first_contact.sh $DRY
  tar czf "$O/$name.tgz" -C "$O/$name" results 2>/dev/null
}

case $CALL in
  A)
    part a_1b_32k STEPS="env baseline peers" BASELINE_LIMIT=60 \
      BASELINE_ARGS="--preset llama3.2-1b --seq-lens 32768 --sp 1 --fsdp 1 --batch-size 1 --remat save_matmuls \
--attn-keep --loss-chunk 4096 --mlp-chunk 0 $ONE $S" \
      PEER_ROWS=1b-32k PEER_FLAG_SETS="$SAVE1|$SAVE1 --fp8" PEER_ARGS="$S" PEERS_LIMIT=210
    part a_8b_lora_8k STEPS="baseline peers" BASELINE_LIMIT=50 \
      BASELINE_ARGS="--preset llama3.1-8b --seq-lens 8192 --lora-rank 16 --sp 1 --fsdp 1 --batch-size 1 --remat full \
--loss-chunk 4096 --mlp-chunk 4096 --attn-keep --fp8 $ONE $S" \
      PEER_ROWS=8b-lora-8k PEER_FLAG_SETS="$KEEP1|$KEEP1 --fp8" PEER_ARGS="$S --peers transformers+liger" \
      PEERS_LIMIT=150
    ;;
  B)
    part b_hybrid STEPS="peers" PEER_ROWS=qwen3.5-0.8b-8k PEER_FLAG_SETS="KEEP|KEEP --delta-impl pallas" \
      PEER_ARGS="$S --peers transformers" PEERS_LIMIT=150
    part b_tests STEPS="tests" TESTS_LIMIT=100 \
      PYTEST_K="hybrid or lora_with_fp8 or pallas_delta_walk or kept_cudnn or head_groups or one_document_rows"
    part b_8b_lora_32k STEPS="peers" PEER_ROWS=8b-lora-32k PEER_FLAG_SETS="$KEEP1" \
      PEER_ARGS="$S --peers transformers+liger" PEERS_LIMIT=100
    # last, where time is left: the delta rule alone at 32K, both walks at both precisions (the Pallas walk and bf16
    # products never timed), beside cuDNN attention and fla's forward
    part b_delta STEPS="delta" DELTA_ARGS="--seq-lens 32768 --iters 3 --warmup 1" DELTA_LIMIT=90
    ;;
  C)
    part c_1b_8k STEPS="peers" PEER_ROWS=1b-8k PEER_FLAG_SETS="$KEEP1|$SAVE1|$KEEP1 --fp8" PEER_ARGS="$S" \
      PEERS_LIMIT=200
    part c_1b_128k STEPS="peers" PEER_ROWS=1b-128k PEER_FLAG_SETS="$KEEP1" PEER_ARGS="$S --peers transformers+liger" \
      PEERS_LIMIT=150
    ;;
  D)
    part d_8b_lora_64k STEPS="peers" PEER_ROWS=8b-lora-64k PEER_FLAG_SETS="$KEEP1" \
      PEER_ARGS="--steps 2 --warmup 1 --peers transformers+liger" PEERS_LIMIT=150
    part d_packed STEPS="peers" PEER_ROWS=1b-32k-packed4 PEER_FLAG_SETS="KEEP|SAVE" PEER_ARGS="$S" PEERS_LIMIT=200
    ;;
  E)
    part e_fp8_curves STEPS="curves" CURVES_LIMIT=330
    ;;
  *)
    echo "next_calls.sh: unknown call $CALL; choose A, B, C, D or E" >&2
    exit 2
    ;;
esac
ls -l "$O"/*.tgz

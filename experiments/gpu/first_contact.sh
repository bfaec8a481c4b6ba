#!/usr/bin/env bash
# The one command for a lent GPU (one H100 or H200; its image: Python 3.12, jax 0.11.x with the CUDA 13 plugin,
# flax, optax, orbax, chex; no registry). Runs against this checkout on PYTHONPATH, no venv built there:
#   1. versions, the project's requirement ranges against what is installed, nvidia-smi
#   2. the GPU tests (pytest -m gpu: tests/test_gpu.py and the long-sequence ones of tests/test_flash_attention.py)
#   3. experiments/bench_attention.py (ours vs cuDNN vs XLA, 8K and 32K, head_dim 128, packed and not)
#   4. experiments/bench_train.py (llama3.2-1b training step at 8K and 32K tokens), then again with --attn-keep
#   (probe: experiments/probe_cudnn_packed.py, packed rows on cuDNN checked and timed, PROBE_ARGS; in STEPS by name only)
# STEPS (default "env tests attention train") picks steps, run in this file's order (also: peers, delta, curves, profile:
# experiments/bench_peers.py with PEER_ROWS, PEER_FLAG_SETS (its --flag-sets), PEER_ARGS (more of its arguments) and
# PEERS_LIMIT (its seconds, default 420), experiments/bench_delta.py with DELTA_ARGS and DELTA_LIMIT (default 300),
# experiments/fp8_curves.py with CURVES_ARGS and CURVES_LIMIT (default 300 s), experiments/profile_step.py with
# PROFILE_ARGS: argument sets split by "|", PROFILE_LIMIT seconds each); PYTEST_K narrows the GPU tests (pytest -k;
# TESTS_LIMIT their seconds, default 240);
# TRAIN_ATTENTION (default "auto") lists the --attention values bench_train runs, one run each. baseline:
# bench_train.py with BASELINE_ARGS on an earlier commit's package in .baseline/ (BASELINE_LIMIT, default 90 s).
# Each step has its own time limit (7.5 minutes at most in all) and its log; a failing step does not stop the others.
# Everything lands in one folder, $OUT/results (or runs/gpu_first_contact/results), packed as results.tgz beside it.
#
# Before the call, here: `make gpu-wheels` (the project's dependencies the image lacks, into .whl/), then carry .whl;
# for fla's backward (the delta step) also `python experiments/gpu/slim_triton.py`, then carry .triton.
#   bash experiments/gpu/first_contact.sh              # on the GPU machine
#   PYTHON=.venv/bin/python bash experiments/gpu/first_contact.sh --dry-run   # CPU dry run: same steps, tiny sizes
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
BASE=${OUT:-$ROOT/runs/gpu_first_contact}
RES=$BASE/results
rm -rf "$RES" && mkdir -p "$RES"
export PYTHONUNBUFFERED=1
export ULYSSES_JAX_COMMIT=${ULYSSES_JAX_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

if [ $DRY = 0 ]; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ulysses_site \
      .whl/*.whl > "$RES/pip.log" 2>&1 || { echo "first_contact: installing .whl failed (see $RES/pip.log)"; exit 1; }
    export PYTHONPATH=/tmp/ulysses_site
  else
    echo "first_contact: no .whl/*.whl (make gpu-wheels here, then carry .whl): liger-kernel and fla are missing" \
      | tee "$RES/pip.log"
  fi
  # Triton 3.7.1 for fla's backward on Hopper (experiments/gpu/slim_triton.py; carry .triton): unpacked apart, and
  # put first on the path of bench_delta.py's fla process alone (FLA_SITE)
  # (once per machine: the parts of one call share it; the newest archive if several)
  TRITON_TAR=$(ls -t .triton/triton-*-slim.tar.xz 2>/dev/null | head -1)
  if [ -n "$TRITON_TAR" ]; then
    { [ -d /tmp/fla_site/triton ] || { mkdir -p /tmp/fla_site && tar -C /tmp/fla_site -xf "$TRITON_TAR"; }; } \
      && export FLA_SITE=/tmp/fla_site \
      || echo "first_contact: unpacking $TRITON_TAR failed; fla runs on the image's Triton" | tee -a "$RES/pip.log"
  fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [ $DRY = 1 ]; then
  export JAX_PLATFORMS=cpu
  CPU_FLAG=(--allow-cpu)
  QUICK=(--quick)
  ATT_ARGS=(--allow-cpu --quick)
else
  CPU_FLAG=()
  QUICK=()
  ATT_ARGS=(--seq-lens 8192,32768 --head-dims 128 --iters 5)
fi

SUMMARY=$RES/summary.txt
STEPS=${STEPS:-env tests attention train}
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to NAME.log, one summary line
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" ${name%%_*} "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  local note=""
  [ $rc = 124 ] || [ $rc = 137 ] && note=" (stopped at its ${limit}s limit)"
  echo "$name: exit $rc in $((SECONDS - t0)) s$note" | tee -a "$SUMMARY"
}

echo "commit $ULYSSES_JAX_COMMIT, $(date -u '+%Y-%m-%d %H:%M UTC')" | tee "$SUMMARY"
step env 60 "$PY" - <<'EOF'
import importlib.metadata as md, pathlib, re, sys, tomllib
from packaging.requirements import Requirement
print("python", sys.version.split()[0])
reqs = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]["dependencies"]
for r in map(Requirement, reqs):
    try:
        v = md.version(r.name)
        print(f"{r.name} {v}" + ("" if r.specifier.contains(v, prereleases=True) else f"  OUTSIDE {r.specifier}"))
    except md.PackageNotFoundError:
        print(f"{r.name} MISSING")
import jax
import jax.experimental.compute_on as co
print("jax.experimental.compute_on:", [n for n in dir(co) if not n.startswith("_")])
print("backend", jax.default_backend(), [d.device_kind for d in jax.devices()])
try:
    from jax._src.lib import cuda_versions
    print("cudnn", cuda_versions.cudnn_get_version() if cuda_versions else None)
except Exception as e:
    print("cudnn version unknown:", e)
EOF
nvidia-smi > "$RES/nvidia-smi.txt" 2>&1 || true
step probe_cudnn_packed 100 "$PY" experiments/probe_cudnn_packed.py --out-dir "$RES" "${CPU_FLAG[@]}" ${PROBE_ARGS:-}
# -v: each test's line as it ends (a step cut by its limit still says which passed)
step tests_gpu "${TESTS_LIMIT:-240}" "$PY" -m pytest -p no:cacheprovider -m gpu -v -rA ${PYTEST_K:+-k "$PYTEST_K"} \
  tests/test_gpu.py \
  tests/test_flash_attention.py
step attention_bench 80 "$PY" experiments/bench_attention.py --out-dir "$RES" "${ATT_ARGS[@]}"
for attn in ${TRAIN_ATTENTION:-auto}; do
  step train_bench_$attn 60 "$PY" experiments/bench_train.py --attention "$attn" --out-dir "$RES" "${CPU_FLAG[@]}" \
    "${QUICK[@]}"
done
step train_bench_keep 60 "$PY" experiments/bench_train.py --attn-keep --out-dir "$RES" "${CPU_FLAG[@]}" "${QUICK[@]}"
# the before of a before/after in the same call: bench_train.py with BASELINE_ARGS on the package in .baseline/ (an
# earlier commit's, made here by `git archive REV ulysses_jax | tar -x -C .baseline`, carried with the call)
if [ ! -d .baseline/ulysses_jax ]; then
  case " $STEPS " in *" baseline "*) echo "baseline: SKIPPED (no .baseline/ulysses_jax: carry .baseline)" | tee -a "$SUMMARY";; esac
else
  step baseline_package 30 env PYTHONPATH="$ROOT/.baseline:$PYTHONPATH" "$PY" -P -c \
    "import ulysses_jax; print(ulysses_jax.__file__)"  # -P: no working directory first on the path, as for a script
  ONE_CPU=()  # a dry run's baseline on one fake CPU device, as the GPU's (BASELINE_ARGS name --sp 1 --fsdp 1)
  [ $DRY = 1 ] && ONE_CPU=(XLA_FLAGS=--xla_force_host_platform_device_count=1)
  step baseline "${BASELINE_LIMIT:-90}" env "${ONE_CPU[@]}" PYTHONPATH="$ROOT/.baseline:$PYTHONPATH" "$PY" \
    experiments/bench_train.py \
    --out-dir "$RES/baseline" "${CPU_FLAG[@]}" "${QUICK[@]}" ${BASELINE_ARGS:-}
fi
# issue 38: ours beside transformers (+peft) and transformers + Liger, same call (PEER_ROWS: bench_peers.py --list;
# a dry run takes the tiny rows instead, with the same flag sets)
[ $DRY = 1 ] && PEER_ROWS=
step peers "${PEERS_LIMIT:-420}" "$PY" experiments/bench_peers.py --out-dir "$RES" --timeout 200 \
  --deadline $((${PEERS_LIMIT:-420} - 15)) "${CPU_FLAG[@]}" "${QUICK[@]}" ${PEER_ROWS:+--rows "$PEER_ROWS"} ${PEER_FLAG_SETS:+--flag-sets "$PEER_FLAG_SETS"} ${PEER_ARGS:-}
# issue 39: the delta rule, ours at both precisions (highest, bf16 products) and both walks (xla, pallas)
# beside fla and cuDNN (DELTA_ARGS: more)
step delta "${DELTA_LIMIT:-300}" "$PY" experiments/bench_delta.py --out-dir "$RES" "${CPU_FLAG[@]}" "${QUICK[@]}" \
  ${DELTA_ARGS:-}
# issue 40: the loss of the same run with and without --fp8, two curves in one plot (CURVES_ARGS: fp8_curves.py's
# arguments instead of the goal's run)
CURVES_DEFAULT="--preset llama3.2-1b --steps 200 --seq-len 4096 --fp8-recipe both"
[ $DRY = 1 ] && CURVES_DEFAULT="--preset tiny --steps 6 --seq-len 128 --fp8-recipe both"
step curves "${CURVES_LIMIT:-300}" "$PY" experiments/fp8_curves.py --out-dir "$RES" "${CPU_FLAG[@]}" \
  ${CURVES_ARGS:-$CURVES_DEFAULT}
# PROFILE_ARGS: one argument set, or several separated by "|" (one profile each, each under its own limit)
IFS='|' read -ra PROFILE_SETS <<< "${PROFILE_ARGS:---seq-lens 32768 --attn-keep}"
for i in "${!PROFILE_SETS[@]}"; do
  step profile_$i "${PROFILE_LIMIT:-120}" "$PY" experiments/profile_step.py --out-dir "$RES" --sp 1 --fsdp 1 \
    --batch-size 1 "${CPU_FLAG[@]}" "${QUICK[@]}" ${PROFILE_SETS[$i]}
done

tar czf "$BASE/results.tgz" -C "$RES" .
echo "== last lines of each log =="
for f in "$RES"/*.log; do echo "--- $(basename "$f")"; tail -n 6 "$f"; done
echo "== summary =="
cat "$SUMMARY"

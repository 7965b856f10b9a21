#!/usr/bin/env bash
# The GPU proof on the GPU machine: installs the carried wheels, then runs scripts/gpu_proof.py run.
#
#   here, once:           python scripts/gpu_proof.py assemble          (fills .gpu-bundle/, needs PyPI)
#   device call, carry [".gpu-bundle"]:  bash scripts/gpu_proof.sh --parts env,correctness
#   further calls:        bash scripts/gpu_proof.sh --parts throughput   /   --parts memory
#
# The wheels go into a --target folder put first on PYTHONPATH, so they take precedence over the image's own
# versions (transformers 5.17 -> 5.23, ...) while torch stays the image's. Results: $OUT/gpu_proof.{json,md},
# $OUT/bench/, and this run's whole log in $OUT/gpu_proof.log. PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
python=${PYTHON:-python3}
site=${GPU_PROOF_SITE:-/tmp/gpu-proof-site}
out=${OUT:-outputs/gpu-proof}
if ! ls .gpu-bundle/*.whl >/dev/null 2>&1; then
    echo "gpu_proof.sh: no wheels in .gpu-bundle/: run 'python scripts/gpu_proof.py assemble' on a machine with" \
         "PyPI, and name .gpu-bundle in the device call's carry list." >&2
    exit 2
fi
mkdir -p "$out"
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    .gpu-bundle/*.whl || { echo "gpu_proof.sh: installing .gpu-bundle/ into $site failed (see above)" >&2; exit 2; }
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
"$python" scripts/gpu_proof.py run --out "$out" "$@" 2>&1 | tee "$out/gpu_proof.log"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# Compile, on this CPU machine, the Triton kernels that scripts/gpu_session.sh's table and profile
# load on an H200, into .triton_cache (docs/GUIDE.md, "On a GPU"): carried with the device call
# (carry: [".whl", ".triton_cache"]), gpu_session.sh hands it to Triton there, so the GPU's minutes
# do not pay those compilations where Triton's cache key matches. The key hashes Triton's own
# build (libtriton differs per Python version), its ptxas, the target and the kernels' source and
# specialization: run it under the GPU image's Python 3.12 and Triton 3.6 (the v212 venv of
# GUIDE.md), without TRITON_INTERPRET. gpu_session.sh records how many entries Triton added there
# (0: every kernel was found).
#   bash scripts/prewarm_triton_cache.sh            # SmolLM2 8x1024 and Llama-1B 4x2048, each with and without checkpointing
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.triton_cache}" PYTHONPATH=.
python - <<'PY'
import sys, triton
if sys.version_info[:2] != (3, 12) or not triton.__version__.startswith("3.6"):
    sys.exit(f"prewarm under the GPU image's Python 3.12 and Triton 3.6 (here {sys.version.split()[0]}, "
             f"Triton {triton.__version__}): another build's cache keys would not match there")
PY
for step in "smollm2 8x1024" "llama-1b 4x2048"; do
  set -- $step
  for ckpt in "" --checkpointing; do
    python -m hf_division.bench kernels --step --shape "$1" --size "$2" --layers 1 $ckpt | sed -n 1p  # the report's first line; sed reads the rest
  done
done
echo "$(find "$TRITON_CACHE_DIR" -mindepth 1 -maxdepth 1 | wc -l) entries, $(du -sh "$TRITON_CACHE_DIR" | cut -f1), in $TRITON_CACHE_DIR"

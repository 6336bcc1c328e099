#!/usr/bin/env bash
# The hand-made Cython/C mutants of c_mutants.patch, built and tested in a scratch copy of the
# tree (the checkout's sources and compiled .so are never touched):
#   tests/mutation/c_mutants.sh [SCRATCH_DIR]
# Builds the three extensions once with all three mutants (about two minutes), then runs the
# Cython tests; every mutant must make tests fail (see README.md, "Cython and C mutants").
set -euo pipefail
cd "$(dirname "$0")/../.."
scratch=${1:-$(mktemp -d)}
git ls-files -z | xargs -0 cp --parents -t "$scratch"
cp ppo_fast/*.so "$scratch/ppo_fast/" 2>/dev/null || true
cd "$scratch"
git apply tests/mutation/c_mutants.patch
python setup.py build_ext --inplace > build.log 2>&1
run() { PYTHONPATH=. python -m pytest -q -p no:cacheprovider --hypothesis-profile=mutation "$@" \
  | grep -E "^FAILED|passed|failed" | cut -c1-120 | sort -u | head -n 12 || true; }
echo "== the generic differential test and the numba agreement (kl_penalty: k3's exp - 1 -> exp + 1)"
run tests/test_kernels.py tests/test_cython.py -k "cython and (equals_the_oracle or agrees_with_numba or edges_of_exp)"
echo "== GAE (end = length -> length + 1 past a short row) and the clipped surrogate (lt -> gt), stage tests"
run tests/test_gae.py tests/test_loss.py -k cython

#!/usr/bin/env bash
# Rerun the mutation session: tests/mutation/run.sh [GROUP...]   (default: every *.toml here)
#
# Each group's config names the module(s) it mutates, the targeted test command and the sampled
# operators. cosmic-ray mutates the files IN PLACE and restores them after each mutant: run it on
# a clean checkout, one session at a time per tree, and do not edit the package meanwhile.
# Sessions go to $MUTATION_DIR (default: .mutation/, git-ignored); the report lists survivors.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=tests/mutation
out=${MUTATION_DIR:-.mutation}
mkdir -p "$out"
groups=("$@")
if [ ${#groups[@]} -eq 0 ]; then
  for c in "$here"/*.toml; do groups+=("$(basename "$c" .toml)"); done
fi
for g in "${groups[@]}"; do
  config=$here/$g.toml
  session=$out/$g.sqlite
  rm -f "$session"
  cosmic-ray init "$config" "$session"
  cr-filter-operators "$session" "$config"
  python "$here/sample.py" "$session" "$config"
  cosmic-ray exec "$config" "$session"
  cr-report "$session" --show-diff --surviving-only > "$out/$g.report.txt" || true
  tail -n 3 "$out/$g.report.txt"
  git diff --quiet -- ppo_fast || { echo "ppo_fast is left mutated: git checkout ppo_fast" >&2; exit 1; }
done

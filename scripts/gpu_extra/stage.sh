#!/usr/bin/env bash
# Reassemble the parts pack.sh made (copied into STAGE/x1, STAGE/x2, ...), check them against manifest.tsv and
# install them into /tmp/site beside the kit's vLLM 0.33:  bash stage.sh [STAGE, default /tmp/stagex]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
stage=${1:-/tmp/stagex}
site=${SITE:-/tmp/site}
asm=$(mktemp -d)
for first in "$stage"/x*/*.part00; do
  whl=$(basename "$first" .part00)
  # parts in order of their own names (.part00, .part01, ...), whichever folder holds them
  cat $(ls "$stage"/x*/"$whl".part* | awk -F/ '{print $NF "\t" $0}' | sort | cut -f2) > "$asm/$whl"
done
grep -v '^#' "$here/manifest.tsv" | while IFS=$'\t' read -r file sha; do
  [ -f "$asm/$file" ] || { echo "stage.sh: $file missing: ship every x folder first" >&2; exit 1; }
  echo "$sha  $asm/$file" | sha256sum -c --status || { echo "stage.sh: $file damaged (sha256)" >&2; exit 1; }
done
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" --upgrade "$asm"/*.whl
echo "stage.sh: installed $(ls "$asm" | tr '\n' ' ')into $site"
# nvidia-cutlass-dsl puts its `cutlass` package on sys.path through a .pth file, which --target installs never run.
dsl="$site/nvidia_cutlass_dsl/dsl_packages"
grep -q "$dsl" "$site/env.sh" 2>/dev/null || echo "export PYTHONPATH=\"$dsl:\$PYTHONPATH\"" >> "$site/env.sh"

#!/usr/bin/env bash
# Pack the extra wheels of manifest.tsv (and this repo's own wheel) into folders of at most PIECE_MIB MiB
# for the device tool, after shared/gpu-vllm-0.33's pieces:
#   bash scripts/gpu_extra/pack.sh .whlx      -> .whlx/x1 .whlx/x2 ... (ship one per call, in order)
# On the device, after the kit's stage.sh:  bash scripts/gpu_extra/stage.sh /tmp/stagex
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:?usage: pack.sh OUT_DIR}
piece=$(( ${PIECE_MIB:-48} * 1024 * 1024 - 131072 ))   # bytes per part; 128 KiB left for the folder's other files
cache=${CACHE:-/var/tmp/bigmoe-extra-wheels}
mkdir -p "$cache" "$out"
rm -rf "$out"/x[0-9]*
grep -v '^#' "$here/manifest.tsv" | while IFS=$'\t' read -r file sha; do
  if ! echo "$sha  $cache/$file" | sha256sum -c --status 2>/dev/null; then
    spec=$(echo "$file" | sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/; s/_/-/g')
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$cache" "$spec"
    echo "$sha  $cache/$file" | sha256sum -c --status || { echo "pack.sh: $file: sha256 mismatch" >&2; exit 1; }
  fi
done
rm -f "$cache"/bigmoe-*.whl
python3 -m pip wheel -q --no-deps -w "$cache" "$repo" >/dev/null
# Split every wheel into parts, then fill folders first-fit in order.
parts=$(mktemp -d)
for whl in $(grep -v '^#' "$here/manifest.tsv" | cut -f1) $(cd "$cache" && ls bigmoe-*.whl); do
  split -b "$piece" -d -a 2 "$cache/$whl" "$parts/$whl.part"
done
n=1; used=0; mkdir -p "$out/x$n"
for p in $(ls "$parts" | sort); do
  size=$(stat -c %s "$parts/$p")
  if (( used + size > piece )); then n=$((n + 1)); used=0; mkdir -p "$out/x$n"; fi
  mv "$parts/$p" "$out/x$n/"; used=$((used + size))
done
cp "$here/manifest.tsv" "$here/stage.sh" "$out/x$n/"
rm -rf "$parts"
for d in "$out"/x*; do echo "$(basename "$d") $(du -s --apparent-size -m "$d" | cut -f1) MiB"; done

#!/usr/bin/env bash
# Build what Unsloth needs on the GPU machine (no network there; torch 2.11+cu130, Python 3.12,
# transformers 5.17, peft and accelerate present) as ONE trimmed, xz-compressed site folder,
# because the registry wheels do not fit the 64 MiB the working tree may carry (docs/unsloth.md).
# Run it here, where pip reaches the registry, from the repository root:
#
#   bash bench/preset15/unsloth_carry.sh        # -> .unsloth/site.tar.xz (git-ignored via .git/info/exclude)
#
# Then: run(command="bash bench/preset15/unsloth.sh", carry=[".unsloth"]) on nvidia-h100-x1.
# What is trimmed (not needed to train; see docs/unsloth.md): unsloth's `studio/` web app (80 MB),
# bitsandbytes' libraries for CUDA versions other than 13.0, hf_transfer (a download accelerator),
# torchao's sm90a CUTLASS library (quantization kernels), diffusers (image generation).
set -eu
WHL=${WHL:-/tmp/unsloth_whl}
DEST=${DEST:-.unsloth}
mkdir -p "$WHL" "$DEST"
EXCLUDE=$(git rev-parse --git-path info/exclude)
grep -qx '/.unsloth/' "$EXCLUDE" 2>/dev/null || echo '/.unsloth/' >> "$EXCLUDE"
# versions: Unsloth's newest; each of its needs at the newest version its pins allow (docs/unsloth.md)
PKGS="unsloth==2026.10.9 unsloth_zoo==2026.10.9 xformers==0.0.35 bitsandbytes==0.50.2 trl==1.15.0
      datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 torchao==0.18.0 cut_cross_entropy==25.1.1
      tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.0 msgspec==0.22.0 liger-kernel==0.8.5"
for p in $PKGS; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$WHL" "$p" 2>&1 | grep -v "is ignored" || true
done
echo "registry wheels:"; ls -l "$WHL"/*.whl | awk '{s+=$5; printf "  %9.1f MiB  %s\n", $5/1048576, $9} END {printf "  %9.1f MiB  total\n", s/1048576}'
SITE=$(mktemp -d)/site
mkdir -p "$SITE"
for w in "$WHL"/*.whl; do
  case "$w" in *diffusers*|*hf_transfer*) continue;; esac
  unzip -q -o "$w" -d "$SITE"
done
rm -rf "$SITE/studio" "$SITE/test"
find "$SITE/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name 'libbitsandbytes_cuda130.so' -delete
rm -f "$SITE"/torchao/_C_cutlass_90a*.so
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +
tar cf - -C "$(dirname "$SITE")" site | xz -T0 -9 > "$DEST/site.tar.xz"
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
carry=$(du -b "$DEST/site.tar.xz" | cut -f1)
printf "unpacked site %s MiB; carried archive %.1f MiB; tracked tree %.1f MiB; together %.1f of 64 MiB\n" \
  "$(du -sm "$SITE" | cut -f1)" "$(echo "$carry/1048576" | bc -l)" "$(echo "$tree/1048576" | bc -l)" \
  "$(echo "($carry+$tree)/1048576" | bc -l)"

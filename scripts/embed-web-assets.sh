#!/usr/bin/env bash
# Embeds the dashboard page (src/web/assets/) into the binary as a C source
# (web/assets.h declares it). The Makefile runs it at build time:
#   scripts/embed-web-assets.sh OUT.c
# Only od and sed are needed, so a build still needs nothing but a compiler
# and the shell tools; nothing generated is committed.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: scripts/embed-web-assets.sh OUT.c" >&2; exit 2; }
out=$1
dir=$(dirname "$0")/../src/web/assets

# URL path, file, Content-Type
assets=(
  "/|index.html|text/html; charset=utf-8"
  "/app.js|app.js|text/javascript; charset=utf-8"
  "/style.css|style.css|text/css; charset=utf-8"
  "/favicon.svg|favicon.svg|image/svg+xml"
)

generate() {
  echo "/* GENERATED at build time by scripts/embed-web-assets.sh from src/web/assets/. */"
  echo "#include \"web/assets.h\""
  local i=0
  for a in "${assets[@]}"; do
    IFS='|' read -r path file type <<<"$a"
    echo
    echo "/* $file */"
    echo "static const unsigned char asset_$i[] = {"
    od -An -v -tx1 "$dir/$file" | sed -e 's/ \([0-9a-f][0-9a-f]\)/0x\1,/g' -e 's/^/    /'
    echo "};"
    i=$((i + 1))
  done
  echo
  echo "const k3_web_asset k3_web_assets[] = {"
  i=0
  for a in "${assets[@]}"; do
    IFS='|' read -r path file type <<<"$a"
    echo "    {\"$path\", \"$type\", asset_$i, sizeof asset_$i},"
    i=$((i + 1))
  done
  echo "};"
  echo "const size_t k3_web_nassets = sizeof k3_web_assets / sizeof k3_web_assets[0];"
}

mkdir -p "$(dirname "$out")"
tmp=$(mktemp "$out.XXXXXX")
generate >"$tmp"
mv "$tmp" "$out"

#!/usr/bin/env bash
# Embeds the web pages (src/web/assets/) into the binary as one C source
# (web/assets.h declares its two tables). The Makefile runs it at build time:
#   scripts/embed-web-assets.sh OUT.c
# Only od and sed are needed, so a build still needs nothing but a compiler
# and the shell tools; nothing generated is committed.
#   k3_web_assets     the dashboard's page (k3 dashboard)
#   k3_serve_assets   the chat page (k3 serve), from src/web/assets/chat/
# The chat page renders replies as Markdown with Debian's libjs-marked and
# node-dompurify (the sanitiser), embedded from where those packages put
# them (MARKED_JS, PURIFY_JS override). Without them the build goes on with a
# note, and /marked.js and /purify.js are a one-line placeholder each: the
# page then shows replies as plain text.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: scripts/embed-web-assets.sh OUT.c" >&2; exit 2; }
out=$1
dir=$(dirname "$0")/../src/web/assets
MARKED_JS=${MARKED_JS:-/usr/share/javascript/marked/marked.umd.min.js}
PURIFY_JS=${PURIFY_JS:-/usr/share/nodejs/dompurify/dist/purify.min.js}
mkdir -p "$(dirname "$out")"
# lib FILE PACKAGE: FILE if it is there, else a placeholder (and a note)
lib() {
  if [ -r "$1" ]; then echo "$1"; return; fi
  local stub
  stub="$(cd "$(dirname "$out")" && pwd)/absent-$(basename "$1")"
  echo "// $2 was not installed when k3 was built: the chat page shows replies as plain text." >"$stub"
  echo "note: $1 missing (Debian package $2): the chat page of k3 serve will show replies as plain text" >&2
  echo "$stub"
}
marked=$(lib "$MARKED_JS" libjs-marked)
purify=$(lib "$PURIFY_JS" node-dompurify)

# URL path, file, Content-Type
dash_assets=(
  "/|index.html|text/html; charset=utf-8"
  "/app.js|app.js|text/javascript; charset=utf-8"
  "/style.css|style.css|text/css; charset=utf-8"
  "/favicon.svg|favicon.svg|image/svg+xml"
)
chat_assets=(
  "/|chat/index.html|text/html; charset=utf-8"
  "/chat.js|chat/chat.js|text/javascript; charset=utf-8"
  "/chat.css|chat/chat.css|text/css; charset=utf-8"
  "/marked.js|$marked|text/javascript; charset=utf-8"
  "/purify.js|$purify|text/javascript; charset=utf-8"
  "/favicon.svg|favicon.svg|image/svg+xml"
)

n=0  # arrays are numbered across both tables
# table NAME ASSET...: the byte arrays, then the table and its count
table() {
  local name=$1 first=$n
  shift
  for a in "$@"; do
    IFS='|' read -r path file type <<<"$a"
    echo
    echo "/* ${file##*/} */"
    echo "static const unsigned char asset_$n[] = {"
    case "$file" in /*) ;; *) file=$dir/$file ;; esac  # the libraries: absolute
    od -An -v -tx1 "$file" | sed -e 's/ \([0-9a-f][0-9a-f]\)/0x\1,/g' -e 's/^/    /'
    echo "};"
    n=$((n + 1))
  done
  echo
  echo "const k3_web_asset ${name}[] = {"
  local i=$first
  for a in "$@"; do
    IFS='|' read -r path file type <<<"$a"
    echo "    {\"$path\", \"$type\", asset_$i, sizeof asset_$i},"
    i=$((i + 1))
  done
  echo "};"
  echo "const size_t ${name%_assets}_nassets = sizeof ${name} / sizeof ${name}[0];"
}

generate() {
  echo "/* GENERATED at build time by scripts/embed-web-assets.sh from src/web/assets/. */"
  echo "#include \"web/assets.h\""
  table k3_web_assets "${dash_assets[@]}"
  table k3_serve_assets "${chat_assets[@]}"
}

tmp=$(mktemp "$out.XXXXXX")
generate >"$tmp"
mv "$tmp" "$out"

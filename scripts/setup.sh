#!/usr/bin/env bash
# Installs the Debian packages k3 needs to build and test. Idempotent: packages
# already present are not reinstalled, so the README commands stay fast on a
# machine that has run this once. Needs root (or sudo) only when something is missing.
set -euo pipefail

# Build and run: compiler, JSON (safetensors headers, configs), PCRE2 (the Kimi
# pre-tokenizer pattern needs Unicode properties), libmicrohttpd (dashboard),
# liburing (batched expert reads), nettle (SHA-256 for k3 verify), Open MPI
# (k3 run over several ranks or hosts under mpirun; the build works without it,
# single-process only), marked + DOMPurify (embedded into k3 serve's chat page
# to show replies as sanitised Markdown; the build works without them, the page
# then shows plain text).
BUILD_PKGS="build-essential pkg-config libjansson-dev libpcre2-dev libmicrohttpd-dev liburing-dev nettle-dev openmpi-bin libopenmpi-dev libjs-marked node-dompurify"
# Tests: PyTorch + NumPy for the reference tools (fixtures are committed, so these
# are only needed to regenerate them), Node.js/npm for the tiktoken cross-check,
# Chromium (driven by npm playwright-core) for the dashboard end-to-end test,
# curl for the dashboard's HTTP tests, util-linux for prlimit, pydantic (v1 on
# Debian 12) for the reply objects of the docs' Python client example.
TEST_PKGS="python3 python3-numpy python3-pydantic util-linux nodejs clang chromium curl"

want="$BUILD_PKGS"
case "${1:-}" in
  --test) want="$BUILD_PKGS $TEST_PKGS" ;;
  # --dev: PyTorch for the reference tools; OpenBLAS so that the PyTorch side of
  # the training benchmark runs on an optimised BLAS, not Debian's netlib reference.
  --dev)  want="$BUILD_PKGS $TEST_PKGS python3-torch libopenblas0-pthread" ;;
esac
# Debian's nodejs comes without npm (a separate package); a Node.js that already
# has npm (such as NodeSource's) must not get Debian's npm, which conflicts with it.
if [ "$want" != "$BUILD_PKGS" ] && ! command -v npm >/dev/null 2>&1; then want="$want npm"; fi

missing=()
for p in $want; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "k3 setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The end-to-end tests' npm packages, exactly as package-lock.json says:
# playwright-core (no browser download: it drives Debian's /usr/bin/chromium)
# and the official openai client that drives k3 serve. npm ci also runs when
# node_modules exists but lacks one of them (an older checkout's).
e2e="$(cd "$(dirname "$0")/.." && pwd)/tests/e2e"
if [ "$want" != "$BUILD_PKGS" ] && { [ ! -d "$e2e/node_modules/playwright-core" ] || [ ! -d "$e2e/node_modules/openai" ]; }; then
  echo "k3 setup: npm ci in tests/e2e" >&2
  (cd "$e2e" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi

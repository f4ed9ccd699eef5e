#!/usr/bin/env bash
# Make sure a headless-capable Chromium is installed (Debian's package `chromium`), for the /ui browser test.
# Idempotent and quiet: does nothing when chromium is already on PATH; installs it with apt-get when run as
# root; otherwise says what is missing and exits 0 (the test then skips with that reason).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "ensure_chromium: chromium is not installed and this is not root; the /ui browser test will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if ! { apt-get install -y -q --no-install-recommends chromium >"$log" 2>&1 ||
       { apt-get update -q >>"$log" 2>&1 && apt-get install -y -q --no-install-recommends chromium >>"$log" 2>&1; }; }; then
    echo "ensure_chromium: apt-get install chromium failed:" >&2
    tail -n 20 "$log" >&2
    rm -f "$log"
    exit 1
fi
rm -f "$log"
command -v chromium >/dev/null

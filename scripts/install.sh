#!/usr/bin/env bash
# Install chatpipe (editable) into .venv with uv: the same versions pip resolves from pyproject.toml,
# in about 50 s instead of pip's 105-130 s on 2 cores (uv downloads, unpacks and byte-compiles in
# parallel). CI and the README's test command use it.
#
#   bash scripts/install.sh          # the pipeline
#   bash scripts/install.sh test     # and the test extras (what CI installs)
#
# `python3 -m venv .venv && .venv/bin/pip install -e '.[test]'` installs the same, more slowly.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

python3 -m venv .venv
.venv/bin/pip install -q uv==0.13.9

# uv does not read pip's configuration. Carry over the keys that choose packages, so both installers
# pick the same wheels: on a machine whose pip.conf points find-links at a local CPU torch wheel,
# uv uses that wheel too instead of the CUDA build on PyPI.
uv_args=()
while IFS= read -r line; do
    key="${line%%=*}"
    value="${line#*=}"
    value="${value//\'/}"
    case "${key##*.}" in
        index-url) uv_args+=(--index-url "$value") ;;
        extra-index-url) for v in $value; do uv_args+=(--extra-index-url "$v"); done ;;
        find-links) for v in $value; do uv_args+=(--find-links "$v"); done ;;
        constraint) for v in $value; do uv_args+=(--constraint "$v"); done ;;
        cert) export SSL_CERT_FILE="$value" ;;  # uv reads the CA bundle from here, as pip from `cert`
    esac
done < <(.venv/bin/pip config list 2>/dev/null)

# pip treats every index alike and takes the best version from any of them; so does unsafe-best-match.
# --compile-bytecode: imports read .pyc files from the first run on (a cold torch + mlflow import
# costs seconds per stage process otherwise), as pip's default install does.
# Hardlinks (uv's default on Linux) from uv's cache instead of copies of torch and its kin: a warm
# reinstall (CI on a machine that ran it before) took 53 and 101 s instead of 109 and 114 s on a busy
# 2-core AMD EPYC. uv copies where it cannot link (another filesystem). Nothing edits installed files.
export UV_LINK_MODE="${UV_LINK_MODE:-hardlink}"
if ! .venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode --index-strategy unsafe-best-match \
    "${uv_args[@]}" -e ".${extras:+[$extras]}"; then
    echo "install.sh: uv failed (above); installing with pip instead" >&2
    .venv/bin/pip install -q -e ".${extras:+[$extras]}"
fi

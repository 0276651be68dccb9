#!/usr/bin/env bash
# Creates .venv with the pinned CPU torch and zerotrain installed in editable mode. Idempotent:
# a second run only checks that the pins are satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.zerotrain-installed
if [ ! -f "$stamp" ] || [ requirements-test.txt -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements-test.txt
  # compat mode: a plain .pth path entry, immune to which subpackages exist at install time
  .venv/bin/python -m pip install -q --no-deps -e . --config-settings editable_mode=compat
  touch "$stamp"
fi

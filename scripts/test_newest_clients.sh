#!/usr/bin/env bash
# The client libraries at their newest releases: builds .venv-newest from requirements-test.txt
# with transformers, accelerate, lightning and peft at the newest versions the package index
# has instead of their pins, prints both, and runs the tests that reach zerotrain through those
# libraries (slow ones included). `make test` keeps the pins, so that a client's release never
# fails a landing; this catches the next rename in a client the day it ships.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-newest
CLIENTS="transformers accelerate lightning peft"
TESTS="tests/test_integration_hf.py tests/test_integration_hf_zero3_load.py
  tests/test_integration_lightning.py tests/test_lora.py tests/test_transformers_gpt2.py
  tests/test_deepspeed_launcher.py tests/test_op_builder.py"
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
mkdir -p build
grep -v -E "^($(echo $CLIENTS | tr ' ' '|'))==" requirements-test.txt > build/requirements-newest.txt
$VENV/bin/python -m pip install -q -r build/requirements-newest.txt
$VENV/bin/python -m pip install -q --upgrade $CLIENTS
$VENV/bin/python -m pip install -q --no-deps -e . --config-settings editable_mode=compat
for client in $CLIENTS; do
  pinned=$(grep -E "^$client==" requirements-test.txt | sed -E 's/^[^=]+==([^ ]+).*/\1/')
  newest=$($VENV/bin/python -c "import importlib.metadata as m; print(m.version('$client'))")
  echo "$client: pinned $pinned, newest $newest"
done
PYTHONDONTWRITEBYTECODE= $VENV/bin/python -m pytest -q -m '' $TESTS "$@"

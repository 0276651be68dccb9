# The two entry points of the README: `make demo` and `make test`. Both set up .venv themselves.
NPROC ?= 2
STEPS ?= 200
ARGS ?=

.PHONY: env demo test test-all test-newest lint gpu-check gpu-wheels

env:
	bash scripts/setup_env.sh

demo: env
	.venv/bin/zerotrain run --nproc-per-node $(NPROC) examples/train_gpt.py --steps $(STEPS) $(ARGS)

# Bytecode caches on, even where the environment turns them off (PYTHONDONTWRITEBYTECODE): the
# suite starts dozens of interpreters, and each would compile zerotrain again (0.35 s).
test: env
	PYTHONDONTWRITEBYTECODE= .venv/bin/python -m pytest -q

test-all: env
	PYTHONDONTWRITEBYTECODE= .venv/bin/python -m pytest -q -m ''

# The tests that reach zerotrain through transformers, accelerate, lightning and peft, with those
# at their newest releases instead of the pins (in .venv-newest; prints both versions).
test-newest:
	bash scripts/test_newest_clients.sh $(ARGS)

# The type checker's scope, interpreter and preset are in pyproject.toml ([tool.pyrefly]).
lint: env
	.venv/bin/ruff check zerotrain tests examples bench
	.venv/bin/ruff format --check zerotrain tests examples bench
	.venv/bin/pyrefly check

# On a machine with one GPU, in the Python that has its CUDA torch (not .venv): tests/test_cuda.py
# and a short benchmark of every GPU path (estimated 5 minutes) into $(OUT)/results.json. Packages
# that Python lacks come from the wheels `make gpu-wheels` downloads (bench/README.md#gpu_checkpy).
PYTHON ?= python3
OUT ?= bench/results/gpu_check
gpu-check:
	$(PYTHON) bench/gpu_check.py --out $(OUT) $(ARGS)

gpu-wheels:
	bash scripts/gpu_wheels.sh

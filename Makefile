# The two entry points of the README: `make demo` and `make test`. Both set up .venv themselves.
NPROC ?= 2
STEPS ?= 200
ARGS ?=

.PHONY: env demo test test-all lint

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

# The type checker's scope, interpreter and preset are in pyproject.toml ([tool.pyrefly]).
lint: env
	.venv/bin/ruff check zerotrain tests examples bench
	.venv/bin/ruff format --check zerotrain tests examples bench
	.venv/bin/pyrefly check

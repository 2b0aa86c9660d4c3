# Two entry points for people: `make demo` and `make test`. Each sets itself up.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Exactly the CPU wheel that lies on local disk; an unpinned torch is a ~3 GB CUDA build.
TORCH := torch==2.13.0

.PHONY: demo test lint typecheck pytest bench system-deps clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,torch]"
	touch $(STAMP)

# openssh-server and rsync back the end-to-end tests; installed only when
# running as root and missing (CI and fresh dev boxes of this kind).
system-deps:
	@if [ "$$(id -u)" = 0 ] && { ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ] || ! command -v rsync >/dev/null; }; then \
		echo "installing openssh-server and rsync"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client rsync >/dev/null; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/vermin -q --no-tips --violations -t=3.9- --eval-annotations --backport dataclasses protocol onbox

typecheck: $(STAMP)
	$(BIN)/mypy --platform linux protocol onbox controller profiles

pytest: $(STAMP) system-deps
	$(BIN)/pytest -q

test: lint typecheck pytest

demo: $(STAMP) system-deps
	$(BIN)/python scripts/demo.py

bench: $(STAMP)
	$(BIN)/python bench/transport.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

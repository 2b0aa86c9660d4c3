# Two entry points for people: `make demo` and `make test`. Each sets itself up.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch: exactly the CPU wheel that lies on local disk (an unpinned torch is a ~3 GB CUDA build);
# the [torch] extra pins the same version.

.PHONY: demo test test-setup test-checks test-fast lint typecheck pytest py39 venv39 rewrite-cache rewrite-cache39 bench system-deps clean

# The box's dependencies as wheels for this Python, fetched once while the venv is set up:
# the end-to-end tests install onto a "box" that has no index (`rgt install --wheelhouse`).
WHEELHOUSE := .wheelhouse
# py-spy: optional on the box (the sidecar dumps a hung job's stacks with it); `rgt install` ships it.
BOX_DEPS := "pyzmq>=23,<28" "psutil>=5.9" "nvidia-ml-py>=12.535" "watchdog>=2.1" "click>=8.1" "packaging>=22" \
	"py-spy>=0.3"

# The two venvs are set up at once (`make test`); their editable installs both write the source
# tree's egg-info, so they take turns under this lock.
INSTALL_LOCK := .install.lock
# Bytecode on both cores: pip compiles what it installs on one (49 of its 70 s here); compileall
# -j 0 takes 25 s. A third-party file that does not compile for this Python (a template, a
# vendored file for another version) is skipped by pip as well, hence `|| true`.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	flock $(INSTALL_LOCK) $(BIN)/pip install -q --no-compile -e ".[dev,torch]" "torch==2.13.0"
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	$(BIN)/pip download -q --only-binary=:all: -d $(WHEELHOUSE) $(BOX_DEPS)
	touch $(STAMP)

# openssh-server and rsync back the end-to-end tests, slurm-wlm and munge the real Slurm cluster of
# tests/slurm; installed only when running as root and missing (CI and fresh dev boxes of this
# kind), in one apt-get, beside the venvs' set-up. Slurm is best effort: without it tests/slurm
# skips, each test saying why.
system-deps:
	@if [ "$$(id -u)" = 0 ] && { ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ] || ! command -v rsync >/dev/null \
			|| [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/munged ]; }; then \
		echo "installing openssh-server, rsync, slurm-wlm and munge"; \
		apt-get update -qq && { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client \
			rsync slurm-wlm munge >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			openssh-server openssh-client rsync >/dev/null; }; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/vermin -q --no-tips --violations -t=3.9- --eval-annotations --backport dataclasses protocol rgtlib onbox profiles controller

typecheck: $(STAMP)
	$(BIN)/mypy --platform linux protocol rgtlib onbox controller profiles

# Six workers on two cores: a test's time is partly its jobs' paced steps and its processes'
# waits, and the CPU its jobs take (mostly `import torch` and the frameworks) leaves the cores
# ~80 % busy at four (7m43s at six, 8m25s at four, quiet). loadgroup keeps the tests that share a
# module's fixture on one worker (tests/conftest.py). The bytecode is compiled first: the
# environment may forbid writing it (PYTHONDONTWRITEBYTECODE), and then every process a test
# starts would compile its imports again. -rs: every skipped test says why at the end (here, the
# real-GPU tests and whatever this machine lacks). tests/rerun.py runs pytest and then each failed
# test once more, alone: one that passes there is printed FLAKY and does not fail the run (a bug
# to fix all the same; bench/suite_series.py counts it as a failure). Reports in .test-reports/.
WORKERS ?= $${PYTEST_WORKERS:-6}
RERUN = python -m tests.rerun --report .test-reports/$(1).json --
pytest: $(STAMP) system-deps
	$(BIN)/python -m compileall -q protocol rgtlib onbox controller profiles tests scripts
	$(BIN)/$(call RERUN,main) -q -rs -n $(WORKERS) --dist loadgroup --durations=15

# protocol/, onbox/ and the controller must run on the old Pythons of rental images and laptops.
# vermin and ruff's py39 target catch syntax; this runs tests on a real 3.9 when the machine has one
# (this kind's image ships it through pyenv): every test of protocol/, rgtlib/, onbox/ and
# profiles/ (what runs on a box), and the controller's surface: tests/controller/test_python_floor.py
# (every module imported, every command's --help, the one-line refusal below the floor) and the CLI
# tests, under click 8.1, the last click for 3.9. The rest of the controller's tests run once, in
# `make pytest` (all of them on 3.9 cost ~55 s of the leg's ~110 s on 2 cores, for code that
# vermin already holds to 3.9). About a minute.
# Found by the shell, not $(wildcard): a HOME with a space would split into two words there. The
# value is shell text, single-quoted, as the recipes use it unquoted ($(PY39) -m venv ...).
ifndef PY39
PY39 := $(or $(shell for p in "$${PYENV_ROOT:-$$HOME/.pyenv}"/versions/3.9.*/bin/python3.9; do [ -x "$$p" ] && last=$$p; done; \
	[ -n "$${last:-}" ] && printf "'%s'" "$$last"),python3.9)
endif
VENV39 := .venv39
# The base dependencies, what the tests above use besides (the [plot] extra, PyYAML, a
# setuptools that builds the wheel `rgt install` ships) and the package itself, editable: the
# `rgt` and `rgt-onbox` scripts, and `python -m onbox.cli` from any directory as on a box.
$(VENV39)/.installed: pyproject.toml
	$(PY39) -m venv $(VENV39)
	$(VENV39)/bin/pip install -q --no-compile pyzmq psutil nvidia-ml-py watchdog click packaging "safetensors" numpy tomli pytest pytest-timeout hypothesis \
		"pytest-xdist==3.8.0" "pyyaml>=6" "matplotlib>=3.5" "setuptools>=68"
	flock $(INSTALL_LOCK) $(VENV39)/bin/pip install -q --no-deps --no-build-isolation -e .
	$(VENV39)/bin/python -m compileall -q -j 0 $(VENV39)/lib >/dev/null || true
	touch $@

# The 3.9 venv when this machine has a 3.9 (set up beside the main one by `make test`).
venv39:
	@if $(PY39) -c 'import sys; assert sys.version_info[:2] == (3, 9)' 2>/dev/null; then \
		$(MAKE) --no-print-directory $(VENV39)/.installed; fi

# tests.click81 gives click 8.1's CliRunner 8.2's separate stderr. test_cli_verify.py needs torch
# (no build of the pinned torch for 3.9). Bytecode first, as for pytest.
PY39_CONTROLLER := tests/controller/test_python_floor.py \
	$(filter-out tests/controller/test_cli_verify.py,$(sort $(wildcard tests/controller/test_cli_*.py)))
PY39_TESTS := -k "not fuzz" tests/protocol tests/rgtlib tests/onbox tests/profiles $(PY39_CONTROLLER) \
	tests/test_layout.py::test_nothing_heavy_happens_at_import_time
py39:
	@if $(PY39) -c 'import sys; assert sys.version_info[:2] == (3, 9)' 2>/dev/null; then \
		$(MAKE) --no-print-directory $(VENV39)/.installed && \
		$(VENV39)/bin/python -m compileall -q protocol rgtlib onbox controller profiles tests && \
		$(VENV39)/bin/rgt --help >/dev/null && \
		$(VENV39)/bin/$(call RERUN,py39) -q -p tests.click81 -n $(WORKERS) --dist loadgroup $(PY39_TESTS); \
	else echo "py39: no python3.9 here; vermin and ruff (target py39) are the 3.9 check"; fi

# pytest rewrites the asserts of each test module in each xdist worker: 8 s of CPU per worker
# (collecting the suite takes 16 s, 8 s with the rewritten modules cached). Where the environment
# forbids writing bytecode (PYTHONDONTWRITEBYTECODE) nothing is cached; one collection allowed
# to write fills tests/**/__pycache__/*-pytest-*.pyc for the workers, beside lint and mypy. A
# collection error is not hidden: the run that follows reports it.
REWRITE := env -u PYTHONDONTWRITEBYTECODE
rewrite-cache: $(STAMP)
	$(BIN)/python -m compileall -q protocol rgtlib onbox controller profiles tests scripts
	$(REWRITE) $(BIN)/python -m pytest -q --collect-only -p no:cacheprovider >/dev/null || true
rewrite-cache39:
	@if $(PY39) -c 'import sys; assert sys.version_info[:2] == (3, 9)' 2>/dev/null; then \
		$(MAKE) --no-print-directory $(VENV39)/.installed && \
		$(REWRITE) $(VENV39)/bin/python -m pytest -q -p tests.click81 -p no:cacheprovider --collect-only \
			$(PY39_TESTS) >/dev/null || true; fi

# The two venvs are set up side by side (pip is half I/O); the suites then run one after the
# other: with the 3.9 leg beside the main suite (make -j2) the whole took 13m31s against 12m28s
# serial on this 2-core machine, the suites being CPU-bound enough not to overlap.
# Its three phases are targets of their own, so bench/suite_time.py times each as make test runs it.
test:
	@$(MAKE) --no-print-directory test-setup
	@$(MAKE) --no-print-directory test-checks
	@$(MAKE) --no-print-directory pytest py39
test-setup:
	@$(MAKE) --no-print-directory -j3 $(STAMP) venv39 system-deps
test-checks:
	@$(MAKE) --no-print-directory -j3 lint typecheck rewrite-cache rewrite-cache39

# The inner loop while changing one area, never instead of `make test`: ruff, then the tests
# outside tests/e2e and tests/slurm less the heaviest files (marked slow in tests/conftest.py).
# About a minute on 2 cores once .venv exists.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n 4 -m "not e2e and not slurm and not gpu and not slow" --ignore=tests/e2e \
		--ignore=tests/slurm --ignore=tests/frameworks

demo: $(STAMP) system-deps
	$(BIN)/python scripts/demo.py

bench: $(STAMP)
	$(BIN)/python bench/transport.py
	$(BIN)/python bench/sidecar_overhead.py

clean:
	rm -rf $(VENV) $(VENV39) $(WHEELHOUSE) $(INSTALL_LOCK) .test-reports .pytest_cache .mypy_cache .ruff_cache .demo

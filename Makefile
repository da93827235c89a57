# Two entry points: `make demo` and `make test` (`make test-fast` skips the slow tests). All create
# .venv and install the project first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The project accepts any torch>=2.2; this pin is the fast path on machines that keep this wheel
# locally. Override with `make TORCH_SPEC='torch' test` to let pip choose.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" || $(BIN)/pip install --quiet "torch>=2.2"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/gpipe demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# the suite without the tests marked slow (multi-process runs, calibrations): a few minutes
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) out

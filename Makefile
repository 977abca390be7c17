# One runner for people and CI: every target sets itself up from nothing (a virtualenv in .venv).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# torch is pinned: 2.13.0 resolves to the CPU wheel here, an unpinned torch pulls a multi-GB CUDA build.
TORCH  := torch==2.13.0
DEMO   := $(CURDIR)/out/demo

SOURCES := dumpstore analysis cli tests bench sample_dumps validation

.PHONY: setup demo check test test-all lint format bench samples validate validate-v2 validate-v3 validate-v4 validate-v5 validate-v6 validate-v7 validate-v8 validate-v9 validate-cross validate-longrun clean

setup: $(STAMP)
	$(BIN)/python sample_dumps/fixtures.py  # the tensor samples' .pt files, unpacked once (git-ignored)

# No pip cache: the venv is about 5 GB (mindspore 2.5 GB, torch 0.75 GB), and a cache would hold the wheels twice.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-cache-dir --upgrade pip
	$(BIN)/python -m pip install -q --no-cache-dir $(TORCH)
	$(BIN)/python -m pip install -q --no-cache-dir -e '.[dev,ray,longrun]' mindstudio-probe $(TORCH)
	$(BIN)/python -m compileall -q dumpstore analysis cli  # PYTHONDONTWRITEBYTECODE=1 machines: no compile per process
	touch $(STAMP)

demo: setup
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(BIN)/dumpstore ingest sample_dumps/ref_tensor --run ref --store $(DEMO)/store
	$(BIN)/dumpstore ingest sample_dumps/weight_1pct_tensor --run target --store $(DEMO)/store
	$(BIN)/dumpstore runs --store $(DEMO)/store
	$(BIN)/dumpstore divergence --target target --ref ref --store $(DEMO)/store
	$(BIN)/dumpstore report --target target --ref ref --store $(DEMO)/store --html $(DEMO)/report.html --csv $(DEMO)/report.csv

# The README's test command (and CI's): format, lint, types, then the tests (all but slow and validation).
test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The inner loop: lint and the core tests, without msprobe cross-checks, MindSpore graph dumps, Ray, Chromium and
# the signal/kill tests (marker processes).
check: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -m 'not slow and not validation and not msprobe and not msgraph and not ray and not browser and not processes'

test-all: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -m ''

lint: $(STAMP)
	$(BIN)/python -m ruff format --check $(SOURCES)
	$(BIN)/python -m ruff check $(SOURCES)
	$(BIN)/python -m mypy dumpstore analysis

format: $(STAMP)
	$(BIN)/python -m ruff format $(SOURCES)
	$(BIN)/python -m ruff check --fix $(SOURCES)

bench: $(STAMP)
	$(BIN)/python bench/run.py
	$(BIN)/python bench/replay_speed.py
	$(BIN)/python bench/longrun.py

samples: $(STAMP)
	$(BIN)/python sample_dumps/generate.py

# The held-out validation set (docs/validation.md): make the pairs into validation/.data, then score the verdict.
validate: $(STAMP)
	$(BIN)/python validation/make_pairs.py --out validation/.data
	$(BIN)/python validation/score.py --data validation/.data

# The held-out long runs (docs/longrun.md, "Held-out long runs"): 17 small models trained on CPU under msprobe's
# TrainerMon into validation/longrun/.data, then `dumpstore curves` scored on them.
validate-longrun: $(STAMP)
	$(BIN)/python validation/longrun/make_runs.py --out validation/longrun/.data
	$(BIN)/python validation/longrun/score.py --data validation/longrun/.data

# Validation sets 2 to 9 (docs/validation.md, "Validation set N"): other families on other device mechanisms,
# each set's devices measured, its pairs made into validation/vN/.data, and scored by the same rule.
VSETS := 2 3 4 5 6 7 8 9
$(VSETS:%=validate-v%): validate-v%: $(STAMP)
	$(BIN)/python validation/v$*/devices.py
	$(BIN)/python validation/v$*/make_pairs.py --out validation/v$*/.data
	$(BIN)/python validation/score.py --data validation/v$*/.data

# The clean combinations (docs/validation.md, "Clean combinations"): every set's families on other sets' devices,
# clean pairs only, made into validation/cross/.data; the verdict must stay quiet on each. CROSS_SETS="5" makes only
# the pairs whose family or device is of those sets (added to the key there; the score covers the whole key).
CROSS_SETS ?=
validate-cross: $(STAMP)
	$(BIN)/python validation/cross/make_pairs.py --out validation/cross/.data $(if $(CROSS_SETS),--set $(CROSS_SETS))
	$(BIN)/python validation/score.py --data validation/cross/.data

clean:
	rm -rf $(VENV) out .pytest_cache

# vision_attn — `make demo` and `make test` create .venv when missing and install the project.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# make demo installs the package and its runtime dependencies only; make test adds the test
# extras (pytest, ONNX, the notebook kernel, the caption toolkit, the browser driver) in one go.
# pip would byte-compile the installed packages one file at a time (tens of thousands of files with
# torch); it is told not to. For make demo, compileall writes the .pyc files of the environment and
# of the package's own modules (which an editable install leaves uncompiled) on every core; the
# test processes write those of the modules they import, once (most of the environment is never
# imported): with PYTHONDONTWRITEBYTECODE set (as in many containers) every process would otherwise
# compile the modules it imports again. Like pip, compileall skips a file that does not compile
# (some packages ship sources of other Python versions as test data).
COMPILE = $(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') vision_attn benchmarks >/dev/null || true
STAMP   = $(VENV)/.installed
DEV     = $(VENV)/.installed-dev
DEMO_DIR ?= runs/demo
export VISION_ATTN_DATA ?= $(CURDIR)/.data

.PHONY: install demo test bench lint docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e .
	$(COMPILE)
	touch $(STAMP)

$(DEV): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e '.[dev]'
	# tidecv: the reference of the TIDE tests; without its dependencies (it asks for opencv-python,
	# which would shadow opencv-python-headless); the ones it imports are in the dev extra
	$(PY) -m pip install --quiet --no-compile --no-deps 'tidecv==1.0.1'
	touch $(STAMP) $(DEV)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m vision_attn.demo --output_dir $(DEMO_DIR)

# two workers, one test file each at a time (module fixtures are trained once), one thread each;
# the 15 slowest tests are listed at the end; ruff first (style, imports, lines of at most 120 characters)
test: $(DEV)
	$(PY) -m ruff check vision_attn tests benchmarks docs/generate.py train.py eval.py
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 --dist loadfile --durations=15

bench: $(DEV)
	$(PY) -m benchmarks.suite --json docs/results/performance_suite.json
	$(PY) -m benchmarks.streaming --json docs/results/performance_streaming.json
	$(PY) -m benchmarks.merging --repeats 5 --json docs/results/performance_merging.json
	$(PY) -m benchmarks.cpu_paths --json docs/results/performance_cpu.json
	$(PY) -m benchmarks.predict_loop --json docs/results/performance_predict_loop.json
	$(PY) -m benchmarks.gpu --json docs/results/performance_gpu.json
	$(PY) -m benchmarks.startup --repeats 5 --json docs/results/performance_startup.json
	if ls $(DEMO_DIR)/*/*/checkpoints/last.ckpt >/dev/null 2>&1; then $(PY) -m benchmarks.explanations --demo_dir $(DEMO_DIR) --json docs/results/explanations.json; else echo "no $(DEMO_DIR)/*/<task>/checkpoints/last.ckpt: run make demo for the explanations table"; fi
	ckpt=$$(ls -t $(DEMO_DIR)/*/captioning/checkpoints/last.ckpt 2>/dev/null | head -1); if [ -n "$$ckpt" ]; then $(PY) -m benchmarks.caption_grounding "$$ckpt" --json docs/results/captioning_grounding.json; fi

# the documentation site: the generated pages written again (command line, configuration keys, API,
# results), then built into site/ offline; a broken link or reference, or a docstring warning, fails it
DOCS_STAMP = $(VENV)/.installed-docs
$(DOCS_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) docs/generate.py
	$(PY) -m mkdocs build --strict --quiet

lint: $(DEV)
	$(PY) -m ruff check vision_attn tests benchmarks docs/generate.py train.py eval.py

clean:
	rm -rf runs .pytest_cache site

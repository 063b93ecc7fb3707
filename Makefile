# Two entry points a fresh machine needs: `make run` (serve the embedded default) and
# `make test` (lint, type-check, tests). Both create .venv on first use.
PY := .venv/bin/python
# No bytecode compiled at install: it costs a fresh machine a minute for files no test imports
# (torch alone has thousands); Python compiles what is imported, once, on first import.
PIP := -m pip install -q --no-compile
# ...which holds only where Python may write its bytecode cache. Some machines (this one and
# CI's) set PYTHONDONTWRITEBYTECODE=1, and then every process compiles the ~700 torch modules
# it imports from source again: about 2 s of CPU more for each worker and router a test starts
# (measured: importing the worker takes 3.3 s of CPU without the cache, 1.4 s with it).
unexport PYTHONDONTWRITEBYTECODE

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	# torch first and pinned, so nothing later can pull a different (CUDA) build.
	$(PY) $(PIP) torch==2.13.0
	# NIXL (KV transport over UCX) without deps: plain `pip install nixl` pulls a CUDA torch.
	$(PY) $(PIP) --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	# Triton, so the paged-decode kernel's tests run it on CPU in Triton's interpreter (no deps;
	# a 286 MB wheel). A CUDA torch brings its own pinned Triton instead.
	$(PY) $(PIP) --no-deps triton==3.9.0
	$(PY) $(PIP) -e '.[test]'
	touch $@

install: .venv/.installed

# Debian packages the tests use: etcd-server 3.4 (membership; the tests start and stop their
# own), iproute2 (`ip netns` for the multi-host tests, `tc` for a slow link) and iptables
# (packet loss and partitions for the network fault tests).
system-deps:
	@command -v etcd >/dev/null && command -v ip >/dev/null && command -v iptables >/dev/null \
		&& command -v openssl >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		etcd-server iproute2 iptables openssl; }

# Router + 1 prefill + 1 decode worker on http://127.0.0.1:8000, embedded tiny model; Ctrl-C stops all.
run: install
	$(PY) -m pdserve up

# Outside OpenAI clients the tests drive against `pdserve up` (tests/clients): guidellm and
# aiperf, and the agent frameworks (LangChain's OpenAI binding, the OpenAI Agents SDK; one venv,
# neither pulls torch), pinned, each in its own venv under .venv-clients/ (gitignored, built
# once, reused while the pins are unchanged). torch CPU goes into guidellm's venv first, so
# guidellm's torch requirement never pulls a CUDA build.
GUIDELLM := guidellm==0.8.1
AIPERF := aiperf==0.13.0
AGENTS := langchain-openai==1.8.1 openai-agents==0.24.0
CLIENTS := .venv-clients

$(CLIENTS)/guidellm/.installed:
	rm -rf $(CLIENTS)/guidellm && python3 -m venv $(CLIENTS)/guidellm
	$(CLIENTS)/guidellm/bin/python $(PIP) torch==2.13.0
	$(CLIENTS)/guidellm/bin/python $(PIP) '$(GUIDELLM)'
	echo '$(GUIDELLM)' > $@

$(CLIENTS)/aiperf/.installed:
	rm -rf $(CLIENTS)/aiperf && python3 -m venv $(CLIENTS)/aiperf
	$(CLIENTS)/aiperf/bin/python $(PIP) '$(AIPERF)'
	echo '$(AIPERF)' > $@

$(CLIENTS)/agents/.installed:
	rm -rf $(CLIENTS)/agents && python3 -m venv $(CLIENTS)/agents
	$(CLIENTS)/agents/bin/python $(PIP) $(AGENTS)
	echo '$(AGENTS)' > $@

# A changed pin rebuilds that venv.
client-venvs:
	@grep -qxF '$(GUIDELLM)' $(CLIENTS)/guidellm/.installed 2>/dev/null || rm -f $(CLIENTS)/guidellm/.installed
	@grep -qxF '$(AIPERF)' $(CLIENTS)/aiperf/.installed 2>/dev/null || rm -f $(CLIENTS)/aiperf/.installed
	@grep -qxF '$(AGENTS)' $(CLIENTS)/agents/.installed 2>/dev/null || rm -f $(CLIENTS)/agents/.installed
	$(MAKE) $(CLIENTS)/guidellm/.installed $(CLIENTS)/aiperf/.installed $(CLIENTS)/agents/.installed

# The venvs and the Debian packages install side by side (each is mostly one process's work).
test:
	$(MAKE) -j4 --output-sync=target install system-deps client-venvs
	$(PY) -m ruff check pdserve pdlab tests benchmarks
	$(PY) -m ruff format --check pdserve pdlab tests benchmarks
	# Two pytest runs side by side (each test suite spends most of its time waiting on the
	# processes it starts; names, ports and namespaces carry each run's pid): the chaos suite,
	# its report printed after it ends, beside mypy, the unit, integration and outside-client
	# tests. The outside-client tests must run here, not skip for want of their venvs.
	$(PY) -m mypy & mypy=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests/chaos > .chaos-tests.log 2>&1 & \
	chaos=$$!; \
	PDSERVE_REQUIRE_CLIENTS=1 $(PY) -m pytest -q -p no:cacheprovider --durations=15 \
		tests/unit tests/integration tests/clients; status=$$?; \
	wait $$chaos; chaos_status=$$?; cat .chaos-tests.log; \
	wait $$mypy && test $$status -eq 0 && test $$chaos_status -eq 0

# The GPU check (`pdserve bench gpu-check`, steps in `pdlab/bench/gpu_check/run.py`: parity,
# decode roofline, speed against transformers, KV over CUDA IPC, a split run and its faults, the
# CUDA tests; about 7 minutes on an H100 or H200), run with the machine's own CUDA torch and this
# checkout on PYTHONPATH. Each step's JSON lands in $(GPU_CHECK_OUT) as it ends, and the log
# beside it, so a device call cut short still brings back what was measured; no step starts
# after --budget-s (480 s): give the device call a timeout of about 540 s. Rerun only what failed
# with `make gpu-check GPU_CHECK_ARGS="--step NAME"` (the report keeps the other steps).
# An image without registry access lacks pydantic and prometheus-client: `make gpu-wheels`
# (here, where pip works) downloads them as CPython 3.12 wheels into .whl/, and `make gpu-check`
# installs whatever is in .whl/ into /tmp/site first.
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	prometheus-client==0.26.0
# The device tool's $OUT when it is set (its files come back), else a folder here.
GPU_CHECK_OUT ?= $(if $(OUT),$(OUT),gpu-check)
GPU_CHECK_ARGS ?=
# The GPU machine's own python3 holds its CUDA torch; a test runs the target here with the venv's
# and the CPU (`tests/integration/test_gpu_check.py`), so the recipe itself is checked too.
GPU_PY ?= python3
GPU_CHECK_DEVICE ?= cuda
GPU_WHEELS_DIR ?= .whl
GPU_SITE ?= /tmp/site

gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

gpu-check:
	@if ls $(GPU_WHEELS_DIR)/*.whl >/dev/null 2>&1; then $(GPU_PY) -m pip install -q --no-index \
		--no-deps --no-compile --target $(GPU_SITE) $(GPU_WHEELS_DIR)/*.whl; fi
	mkdir -p $(GPU_CHECK_OUT)
	PYTHONPATH=$(GPU_SITE):$(CURDIR) PYTHONUNBUFFERED=1 $(GPU_PY) -m pdlab bench gpu-check \
		--device $(GPU_CHECK_DEVICE) --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS) \
		> $(GPU_CHECK_OUT)/gpu_check.log 2>&1; \
		status=$$?; cat $(GPU_CHECK_OUT)/gpu_check.log; exit $$status

.PHONY: install system-deps run test client-venvs gpu-wheels gpu-check

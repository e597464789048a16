# The two entry points the README shows; CI runs `make test` (.ci/run).
PYTHON ?= python
PIP ?= $(PYTHON) -m pip

.PHONY: run test setup setup-dev

## Set up and run the embedded default job (examples/correct.toml on a local Ray). The setup
## includes the extras the README's tour uses: gec (aggdec eval --task gec) and report (aggdec report).
run: setup
	aggdec run

## Set up and run the default test suite, two tests at a time (pytest-xdist).
test: setup-dev
	$(PYTHON) -m pytest -m 'not slow' -p no:cacheprovider -n 2 --dist loadgroup

# The package builds the CPU attention kernel against the torch installed first (setup.py):
# without build isolation, which would build it against another copy of torch.
setup:
	$(PIP) install torch==2.13.0 'setuptools>=68'
	$(PIP) install --no-build-isolation -e '.[gec,report]'

# fairseq (for the parity tests) builds against the installed torch; it pulls a torchaudio that
# cannot load with torch 2.13 and is not needed, so it is removed again (with it installed,
# transformers cannot import its model classes; the HF import tests need both).
setup-dev:
	$(PIP) install torch==2.13.0 'setuptools>=68' cython numpy wheel
	MAX_JOBS=2 $(PIP) install --no-build-isolation fairseq-fixed==0.12.3.1
	$(PIP) uninstall -y torchaudio
	$(PIP) install --no-build-isolation -e '.[dev,gec,report,hf]'

# The README's two commands: `make demo` (the main job, locally) and `make test` (all tests).
# Both run the set-up first; it is idempotent and quick once done.
SHELL := /bin/bash
export CDK_DISABLE_VERSION_CHECK := 1
export CDK_DISABLE_CLI_TELEMETRY := true
export AWS_EC2_METADATA_DISABLED := true
export PATH := $(CURDIR)/.venv/bin:$(CURDIR)/node_modules/.bin:$(PATH)

.PHONY: setup demo test test-image-torch synth lint lock clean

setup:
	@bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh 2

# make test: everything but the emulated cluster on two workers, beside it the cluster tests no other load
# can fail and the training program's tests on the training image's Python, torch and numpy (test-image-torch);
# then the `timed` cluster tests alone. One line at the end gives each part's wall time (scripts/test_phases.sh).
test: setup
	bash scripts/test_phases.sh

test-image-torch: setup  # the training program's tests on the image's torch (stacks/images.py); env cached per lock
	bash scripts/test_image_torch.sh

# Offline synth pins what `fab preflight` would (synth refuses to guess the AZ or the AMI) and a
# documentation address (RFC 5737) as ssh_cidr: a template to read and lint, not one to deploy.
SYNTH_CONTEXT := -c ssh_cidr=203.0.113.7/32 -c availability_zone=us-east-1a -c ami_id=ami-0123456789abcdef0
synth: setup
	cdk synth --no-notices -q $(SYNTH_CONTEXT)

LINTED := stacks clusterops fabfile app.py tests scripts assets
lint: setup  # ruff (lint and format), mypy, shellcheck, cfn-lint on the synthesized template
	ruff check $(LINTED)
	ruff format --check $(LINTED)
	mypy --explicit-package-bases stacks clusterops fabfile app.py assets/train assets/cluster_node
	shellcheck $$(git ls-files '*.sh')
	cdk synth --no-notices -q -o cdk.out $(SYNTH_CONTEXT) && cfn-lint cdk.out/*.template.json

lock:  # after editing a requirements file: pin every package, transitive ones included, with hashes
	.venv/bin/uv pip compile requirements-dev.txt --generate-hashes --find-links /opt/wheels \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header -o requirements.lock
	.venv/bin/uv pip compile requirements-image.txt --generate-hashes \
	  --python-version $$(.venv/bin/python -c 'from stacks import images; print(images.default().python)') \
	  --python-platform x86_64-manylinux_2_28 --no-header -o requirements-image.lock

clean:
	rm -rf cdk.out .pytest_cache runs

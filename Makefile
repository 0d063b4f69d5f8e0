# chatcore — every task a newcomer or CI needs. `make help` lists them.
SWIFT   ?= swift
PYTHON  ?= python3
LISTEN  ?= 127.0.0.1:7400
RELEASE := .build/release/chatcore

.PHONY: help setup build run test test-swift test-python generate check-generated bench clean

help: ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

setup: ## install the system packages and Python test tools (Debian; run as root)
	@missing=""; for p in libyajl-dev libsqlite3-dev pkg-config; do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing:$$missing"; apt-get update -qq && apt-get install -y -qq $$missing; fi
	@$(PYTHON) -c "import jsonschema, referencing, pytest" 2>/dev/null || \
	  $(PYTHON) -m pip install --quiet pytest "jsonschema>=4.18" 2>/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq python3-pytest python3-jsonschema)
	@command -v $(SWIFT) >/dev/null || { echo "Swift 6.1 or later is needed: https://www.swift.org/install/linux/"; exit 1; }

build: setup ## build the release binary
	$(SWIFT) build -c release --product chatcore

run: build ## set up, build and start the service on $(LISTEN) (any token accepted: loopback only)
	@echo
	@echo "chatcore is starting on $(LISTEN). In another terminal:"
	@echo "    nc $(subst :, ,$(LISTEN))"
	@echo '    {"authToken":{"userId":"alice","authToken":"any"}}'
	@echo '    {"identitiesGet":{"cookie":"1","userIds":["alice"]}}'
	@echo "Examples/netcat.md walks through more. Ctrl-C stops it; data stays in ~/.local/share/chatcore."
	@echo
	exec $(RELEASE) serve --listen $(LISTEN) --insecure-no-auth

test: setup test-swift test-python ## set up and run every test

test-swift: check-generated
	$(SWIFT) build --build-tests
	$(SWIFT) test

test-python:
	$(SWIFT) build --product chatcore
	CHATCORE_BINARY=$(CURDIR)/.build/debug/chatcore $(PYTHON) -m pytest -q Tests/python Examples

generate: ## regenerate Sources/Protocol/Generated from Schemas/
	$(SWIFT) run chatcore-codegen Schemas Sources/Protocol/Generated

check-generated: ## fail when the generated code and Schemas/ disagree
	$(SWIFT) run chatcore-codegen --check Schemas Sources/Protocol/Generated

bench: setup ## run the benchmarks and print a table
	$(SWIFT) build -c release --product chatcore
	$(SWIFT) build -c release --product chatcore-bench
	$(PYTHON) Benchmarks/run.py

clean:
	rm -rf .build Benchmarks/out

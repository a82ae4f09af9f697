"""`phaseserve bench`: the benchmark client installed with the product (an OpenAI-compatible server under a
seeded workload, or the in-process engine). The experiments that drive it live in the repo's bench/."""

"""`pdserve bench gpu-check` (`make gpu-check`): the engine on a GPU, checked and measured.

Each step is a module here with `run(workdir, args) -> dict` (`cuda_tests` runs pytest);
`run.py` orders them, most important first, and writes each one's JSON as soon as it ends, so a
run cut short still reports what it measured. Light at import: the bench parser reads `STEPS`.
"""

# In the order they run; `run.py` says what each one checks.
STEPS = (
    "parity",
    "roofline",
    "vs_transformers",
    "device_transfer",
    "disaggregated",
    "device_faults",
    "cuda_tests",
)

"""What the batch-invariant forward costs: the same workloads with it on and off, side by side.

Each workload runs on one engine per setting (tiny model unless --model, one intra-op thread,
prefix cache off so every run computes the same tokens), best of --repeats after a warm-up;
the JSON has seconds per setting and the on/off ratio per workload. It also counts how many
of a request's positions get different logits when the request runs alone versus next to
other requests and after a resume, per setting (0 expected with the mode on).

    .venv/bin/python benchmarks/batch_invariance.py [--json out.json] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from pdserve.config import EngineConfig, ModelLoadConfig  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.model.loader import LoadedModel, load_model  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402

# (name, prompt tokens, concurrent requests, output tokens)
WORKLOADS = [
    ("prefill 512", 512, 1, 1),
    ("decode 1 x 64", 16, 1, 64),
    ("decode 8 x 64", 16, 8, 64),
    ("mixed 4 x (256 + 32)", 256, 4, 32),
]


def _engine(model: LoadedModel, invariant: bool) -> Engine:
    load = ModelLoadConfig(path=str(model.path))
    config = EngineConfig(model=load, enable_prefix_caching=False, batch_invariant=invariant,
                          num_blocks=512)  # fmt: skip
    return Engine(model, config)


def _time(eng: Engine, prompt_len: int, num: int, max_tokens: int, repeats: int, tag: str) -> float:
    best = float("inf")
    for rep in range(repeats + 1):  # the first is the warm-up
        for i in range(num):
            ids = [7 + i, *range(5, 4 + prompt_len)]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            eng.add_request(f"{tag}-{rep}-{i}", ids, params)
        start = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        if rep:
            best = min(best, time.perf_counter() - start)
    return best


def _differing_positions(model: LoadedModel, invariant: bool) -> dict[str, int]:
    """Positions whose logprobs differ from a lone run: batched with others, and resumed."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    ids = list(range(5, 75))

    def run(outputs: list[int] | None, others: int) -> list[float]:
        eng = _engine(model, invariant)
        eng.add_request("x", ids, params, output_token_ids=outputs)
        for j in range(others):
            eng.add_request(f"o{j}", list(range(9, 30 + 7 * j)), params)
        lps: list[float] = []
        while eng.has_unfinished():
            lps += [lp.logprob for d in eng.step() if d.request_id == "x" for lp in d.logprobs]
        return lps

    alone = run(None, 0)
    tokens_eng = _engine(model, invariant)
    req = tokens_eng.add_request("t", ids, params)
    while tokens_eng.has_unfinished():
        tokens_eng.step()
    batched = run(None, 3)
    resumed = run(list(req.output_token_ids[:8]), 0)
    return {
        "batched": sum(a != b for a, b in zip(alone, batched, strict=True)),
        "resumed_after_8": sum(a != b for a, b in zip(alone[8:], resumed, strict=True)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder (default: the tiny model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.model is None:
        from pdserve.model.tiny import default_model_path

        args.model = str(default_model_path())
    model = load_model(args.model)
    rows = []
    for name, prompt_len, num, max_tokens in WORKLOADS:
        off = _time(_engine(model, False), prompt_len, num, max_tokens, args.repeats, "off")
        on = _time(_engine(model, True), prompt_len, num, max_tokens, args.repeats, "on")
        rows.append({"workload": name, "off_s": off, "on_s": on, "ratio_on_off": on / off})
        print(f"{name:24s} off {off:7.4f} s  on {on:7.4f} s  on/off {on / off:5.2f}")
    diffs = {str(mode): _differing_positions(model, mode) for mode in (False, True)}
    print(f"positions with different logprobs than a lone run (of 20): {diffs}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"workloads": rows, "differing_positions": diffs}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The KV canary's cost per handoff next to one decode step, on the same engine.

For each model (the tiny default; a KV-heavy Llama layout with head_dim 128 and 32 KV heads,
built here with transformers' `save_pretrained`, no download) and prompt length: the time of
`Engine.canary_logits` (the one-token forward each side of a handoff runs) against one decode
step of a single running request, medians of repeated runs, side by side in one process.
Prints a table; `--json FILE` writes the figures with `canary_over_decode_step` ratios.

    .venv/bin/python benchmarks/canary_cost.py [--json canary.json] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.engine import Engine
from pdserve.model.loader import load_model
from pdserve.model.tiny import default_model_path
from pdserve.protocol.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from checkpoints import kv_heavy_config, save_hf_checkpoint


def measure(model_dir: Path, prompt_len: int, repeats: int) -> dict[str, float]:
    model = load_model(str(model_dir))
    engine = Engine(model, EngineConfig(model=ModelLoadConfig(path=str(model_dir)), num_blocks=256))
    rng = random.Random(0)
    prompt = [rng.randrange(3, 2000) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=repeats + 8, temperature=0.0, ignore_eos=True)
    engine.add_request("r", prompt, params)
    while engine.get_request("r").num_output_tokens < 4:  # prefill, then warm decode steps
        engine.step()
    canary, step = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        engine.canary_logits("r")
        canary.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.step()
        step.append(time.perf_counter() - t)
    c, s = statistics.median(canary), statistics.median(step)
    return {"canary_ms": c * 1e3, "decode_step_ms": s * 1e3, "canary_over_decode_step": c / s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    heavy = Path(tempfile.mkdtemp()) / "kv-heavy"
    save_hf_checkpoint(heavy, kv_heavy_config(), default_model_path(), seed=7)
    rows = []
    for name, folder in (("tiny", default_model_path()), ("kv-heavy", heavy)):
        for prompt_len in (128, 1024):
            rows.append({"model": name, "prompt_tokens": prompt_len,
                         **measure(folder, prompt_len, args.repeats)})  # fmt: skip
    print(f"{'model':<10} {'prompt':>7} {'canary ms':>10} {'decode step ms':>15} {'ratio':>7}")
    for r in rows:
        print(
            f"{r['model']:<10} {r['prompt_tokens']:>7} {r['canary_ms']:>10.2f}"
            f" {r['decode_step_ms']:>15.2f} {r['canary_over_decode_step']:>7.2f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

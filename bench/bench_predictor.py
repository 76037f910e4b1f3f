"""Per-prompt latency of the prompt predictors, side by side on the same prompts (accuracy: see
`moe-l2 predict --cross-validate TRACE [--predictor embedding]`).

    python bench/bench_predictor.py [--trace ../shared/traces/gpt-oss-20b.jsonl.gz]

The embedding predictor needs `pip install 'mlx-moe-l2[embed]'`; without it only naive Bayes is timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from moe_l2.cache.prediction import PredictorError
from moe_l2.cache.profile import train_predictor
from moe_l2.cache.trace import read_traces

DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "gpt-oss-20b.jsonl.gz"


def per_prompt_ms(predictor, prompts: list[str]) -> list[float]:
    times = []
    for text in prompts:
        start = time.perf_counter()
        predictor.predict(text)
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    args = parser.parse_args()
    examples = [(s.prompt, s.domain) for s in read_traces(args.trace).sequences if s.prompt and s.domain]
    # Timed on prompts the predictor has not seen (the embedding predictor caches what it encoded).
    train, prompts = examples[::2], [text for text, _ in examples[1::2]]
    print(f"{len(examples)} prompts of {args.trace.name}: trained on {len(train)}, timed on {len(prompts)}")
    medians = {}
    for kind in ("naive-bayes", "embedding"):
        try:
            start = time.perf_counter()
            predictor = train_predictor(train, kind)  # loads the encoder, if any: once per process
            setup_s = time.perf_counter() - start
            predictor.predict("warm-up")
        except PredictorError as exc:
            print(f"  {kind:12s} skipped: {exc}")
            continue
        times = per_prompt_ms(predictor, prompts)
        medians[kind] = statistics.median(times)
        p95 = sorted(times)[int(0.95 * len(times))]
        print(f"  {kind:12s} median {medians[kind]:8.3f} ms  mean {statistics.mean(times):8.3f} ms  "
              f"p95 {p95:8.3f} ms  (training, encoder load included: {setup_s:.1f} s)")
    if len(medians) == 2:
        print(f"  embedding / naive-bayes median: {medians['embedding'] / medians['naive-bayes']:.0f}x")


if __name__ == "__main__":
    main()

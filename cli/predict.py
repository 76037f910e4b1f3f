"""`moe-l2 predict`: name a prompt's domain with a profile's predictor, or measure a predictor's held-out
accuracy on traces. The predictors are in `moe_l2.cache.prediction` and `moe_l2.cache.embedding`."""

from __future__ import annotations

import json
import sys

from moe_l2.cache.prediction import NaiveBayes, PredictorError, cross_validate
from moe_l2.cache.profile import KINDS, Profile, ProfileError, train_predictor
from moe_l2.cache.trace import TraceError, read_traces
from moe_l2.model.location import path_arg
from moe_l2.sizes import format_pct


def add_arguments(parser) -> None:
    parser.add_argument("text", nargs="*", help="prompt text (read from stdin when absent and no --eval)")
    parser.add_argument("--profile", type=path_arg, metavar="P.json", help="profile whose predictor names the domain")
    parser.add_argument("--eval", nargs="+", type=path_arg, metavar="TRACE",
                        help="accuracy of the profile's predictor on these traces' prompts (held out if the "
                             "profile was built from other traces)")
    parser.add_argument("--cross-validate", nargs="+", type=path_arg, metavar="TRACE",
                        help="train on folds of these traces' prompts and report held-out accuracy (no profile)")
    parser.add_argument("--predictor", choices=KINDS, default=NaiveBayes.kind,
                        help="with --cross-validate: the backend to train (embedding needs the embed extra)")
    parser.add_argument("--folds", type=int, default=5, help="cross-validation folds (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="fold assignment seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    def fail(msg: str, status: int = 1) -> int:
        print(f"moe-l2 predict: {msg}", file=sys.stderr)
        return status

    try:
        if args.cross_validate:
            if args.folds < 2:
                return fail("--folds must be at least 2", 2)
            traces = read_traces(args.cross_validate)
            examples = [(s.prompt, s.domain) for s in traces.sequences if s.prompt and s.domain]
            if len({d for _, d in examples}) < 2:
                return fail("the traces need prompts of at least two domains")
            kind = getattr(args, "predictor", NaiveBayes.kind)
            result = cross_validate(examples, args.folds, seed=args.seed,
                                    train=lambda ex: train_predictor(ex, kind))
            if args.json:
                print(json.dumps(result, indent=1))
            else:
                print(f"{result['examples']} prompts, {args.folds}-fold cross-validation: accuracy "
                      f"{format_pct(result['accuracy'])} (majority class {format_pct(result['majority_baseline'])}); "
                      f"{format_pct(result['confident_share'], 0)} of predictions have confidence >= 0.5, "
                      f"accuracy among them "
                      + format_pct(result["confident_accuracy"]))
                for d, v in result["per_domain"].items():
                    print(f"  {d:<16} {v['n']:5d} prompts  accuracy {format_pct(v['accuracy']):>6}")
            return 0
        if not args.profile:
            return fail("--profile P.json is required (or --cross-validate TRACE...)", 2)
        profile = Profile.load(args.profile)
        if args.eval:
            traces = read_traces(args.eval)
            examples = [(s.prompt, s.domain) for s in traces.sequences if s.prompt and s.domain]
            if not examples:
                return fail("the traces have no prompts with domain labels")
            correct = sum(profile.predict(t).domain == d for t, d in examples)
            result = {"examples": len(examples), "accuracy": correct / len(examples)}
            print(json.dumps(result) if args.json else
                  f"{len(examples)} prompts: accuracy {format_pct(result['accuracy'])}")
            return 0
        text = " ".join(args.text) if args.text else sys.stdin.read()
        if not text.strip():
            return fail("no prompt text given")
        p = profile.predict(text)
    except (TraceError, ProfileError, PredictorError) as exc:
        return fail(str(exc))
    if args.json:
        print(json.dumps(p.to_json()))
    else:
        print(f"{p.domain}\t{p.confidence:.3f}")
    return 0

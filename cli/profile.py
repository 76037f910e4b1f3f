"""`moe-l2 profile`: build a domain profile (moe_l2.cache.profile) from routing traces or from a running
daemon's online statistics, or show one."""

from __future__ import annotations

import json
import os
import sys

from moe_l2 import control
from moe_l2.cache.prediction import NaiveBayes, PredictorError
from moe_l2.cache.profile import KINDS, Profile, ProfileError
from moe_l2.cache.trace import TraceError, read_traces
from moe_l2.model.location import ModelNotFound, path_arg, resolve_model, socket_arg
from moe_l2.runtime import default_socket


def summarize(profile: Profile) -> str:
    lines = [f"profile of {profile.model}: {profile.n_layers} layers x {profile.n_experts} experts, "
             f"top-{profile.top_k}; sources: {', '.join(profile.sources) or '-'}"]
    total = sum(s.tokens for s in profile.domains.values()) + profile.unlabelled.tokens
    lines.append(f"{len(profile.domains)} domains, {total} tokens"
                 + (f" ({profile.unlabelled.tokens} unlabelled)" if profile.unlabelled.tokens else ""))
    for d in profile.domain_names:
        s = profile.domains[d]
        lines.append(f"  {d:<16} {s.sequences:6d} sequences {s.tokens:8d} tokens")
    spec = profile.specificity
    if spec:
        lines.append("specificity per layer (I(domain; expert) / H(expert)): "
                     + " ".join(f"{x:.3f}" for x in spec))
        lines.append(f"backbone experts per layer: {' '.join(str(len(b)) for b in profile.backbone)}")
    if profile.predictor is not None:
        lines.append(f"predictor: {profile.predictor.kind} over {len(profile.predictor.domains)} domains, "
                     f"{sum(profile.predictor.docs.values())} prompts")
    else:
        lines.append("predictor: none (no prompts with domain labels); hints must name a domain")
    if profile.l0_curves is not None:
        rows = profile.l0_ceilings(list(range(profile.n_layers)), max(profile.top_k, profile.n_experts // 4))
        lines.append(f"L0 ceilings per layer at a quarter of the experts (l0_ceilings, from the LRU hit curves): "
                     f"{' '.join(map(str, rows.values()))}")
    else:
        lines.append("L0 hit curves: none (built from a daemon's counts or by an older moe-l2); L0 ceilings need "
                     "a profile from traces")
    return "\n".join(lines)


def profile_from_daemon(socket: str, model: str | None, base: Profile | None = None,
                        timeout_s: float = 5.0) -> Profile:
    """A profile from a running daemon's online statistics (what its clients reported), optionally added
    to a base profile (whose predictor it keeps)."""
    payload = control.stats(socket, timeout_s, routing=True)  # the trust checks, its shape checked
    models = payload["models"]
    if model is not None:
        try:
            real = os.path.realpath(resolve_model(model))
        except ModelNotFound:
            real = None  # a fingerprint
        models = [m for m in models if m.get("fingerprint") == model or os.path.realpath(m.get("path", "")) == real]
    if len(models) != 1:
        served = ", ".join(m["path"] for m in payload["models"])
        raise ProfileError(f"choose one of the served models with --model (served: {served or 'none'})"
                           if models or model is None else f"the daemon does not serve {model} (served: {served})")
    m = models[0]
    routing = m.get("routing")
    if routing is None:
        raise ProfileError("this daemon does not report online statistics (upgrade moe-l2d)")
    if base is not None:
        base.check_model(m["n_layers"], m["n_experts"], f"served model {m['path']}")
        profile = base
    else:
        profile = Profile(os.path.basename(str(m["path"]).rstrip("/")), m["n_layers"], m["n_experts"], 1)
    for domain, counts in routing.items():
        if len(counts) != profile.n_layers or any(len(row) != profile.n_experts for row in counts):
            raise ProfileError("the daemon's statistics do not match the model's shape")
        profile.add_counts(domain or None, counts)
    profile.sources = [*profile.sources, f"daemon:{socket}"]
    profile.refresh()
    return profile


def add_arguments(parser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--traces", nargs="+", type=path_arg, metavar="FILE", help="routing traces of one model")
    src.add_argument("--from-daemon", action="store_true",
                     help="use the running daemon's online statistics (what its clients reported)")
    src.add_argument("--show", type=path_arg, metavar="P.json", help="print a summary of a profile")
    parser.add_argument("--out", type=path_arg, metavar="P.json", help="where to write the profile")
    parser.add_argument("--socket", default=None, type=socket_arg, help="daemon address for --from-daemon")
    parser.add_argument("--model", default=None,
                        help="with --from-daemon: the served model (path, Hugging Face repo id or fingerprint)")
    parser.add_argument("--base", type=path_arg, metavar="P.json",
                        help="with --from-daemon: add the online counts to this profile (keeps its predictor)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    parser.add_argument("--no-predictor", action="store_true", help="do not train a domain predictor")
    parser.add_argument("--predictor", choices=KINDS, default=NaiveBayes.kind,
                        help="domain predictor to train: naive-bayes (default, no dependency) or embedding "
                             "(sentence embeddings; needs pip install 'mlx-moe-l2[embed]')")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args) -> int:
    if not (args.show or args.out):
        print("moe-l2 profile: --out P.json is required", file=sys.stderr)
        return 2
    try:
        if args.show:
            profile = Profile.load(args.show)
        else:
            if args.traces:
                profile = Profile.from_traces(read_traces(args.traces),
                                              predictor=False if args.no_predictor else args.predictor)
            else:
                base = Profile.load(args.base) if args.base else None
                try:
                    profile = profile_from_daemon(args.socket or default_socket(), args.model, base, args.timeout)
                except (OSError, RuntimeError, control.UntrustedDaemon) as exc:
                    # No answer, no socket or no permission, refused, an impostor, or a malformed reply.
                    print(f"moe-l2 profile: {exc}", file=sys.stderr)
                    return 1
            profile.save(args.out)
    except (TraceError, ProfileError, PredictorError) as exc:
        print(f"moe-l2 profile: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"moe-l2 profile: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if args.json:
        data = profile.to_json()
        data.pop("predictor")
        for d in data["domains"].values():
            d.pop("counts")
        data["unlabelled"].pop("counts")
        data["l0_curves"] = data.pop("l0_curves", None) is not None
        print(json.dumps(data, indent=1))
    else:
        print(summarize(profile))
        if not args.show:
            print(f"wrote {args.out}")
    return 0

"""`moe-l2 verify`: fetch experts through the client path (L2, else the file) and compare every byte with the
model file, and every record with the model's checksum manifest when it has one; `--manifest` writes that
manifest (docs/formats.md, "Checksums")."""

from __future__ import annotations

import argparse
import random
import sys

from moe_l2.model.location import resolve_model, socket_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model directory, or Hugging Face repo id in the local cache")
    parser.add_argument("--socket", default=None, type=socket_arg, help="daemon address (default: the local runtime dir)")
    parser.add_argument("--no-daemon", action="store_true", help="check the pread path only")
    parser.add_argument("--direct-io", choices=("auto", "on", "off"), default="auto",
                        help="read the model files with O_DIRECT / F_NOCACHE (auto: for packed models)")
    parser.add_argument("--samples", type=int, default=64, help="random experts to check (default 64)")
    parser.add_argument("--all", action="store_true", help="check every expert of every layer, not samples")
    parser.add_argument("--manifest", action="store_true",
                        help="write the model's checksum manifest (every record read) when it has none or a "
                             "stale one; when it has a current one, check every expert against it")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the experts picked")


def _write_manifest(files) -> int:
    from tqdm import tqdm

    from moe_l2.model.checksums import DamagedRecord, manifest_of, write_manifest

    with tqdm(total=files.n_layers * files.n_experts, unit="record", desc="checksums", file=sys.stderr,
              disable=None) as bar:
        try:
            manifest = manifest_of(files, bar.update)
        except DamagedRecord as exc:
            print(f"moe-l2 verify: no manifest written: {exc}", file=sys.stderr)
            return 1
    try:
        write_manifest(manifest)
    except OSError as exc:
        print(f"moe-l2 verify: cannot write the checksum manifest: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {manifest.path}: the checksums of {files.n_layers} x {files.n_experts} records of {files.path} "
          f"({files.format}); moe-l2d, the client pool and moe-l2 verify check records against it (restart "
          "moe-l2d to make it check them)")
    return 0


def _problems(files, layer: int, expert: int, tier: str, got: bytes) -> list[tuple[str, str]]:
    """(tier, what is wrong) for a record fetched from tier: the model file's copy against the manifest, and
    the fetched bytes against the manifest (L2) or the plain read of the file (the fast L3 read)."""
    from moe_l2.model import DamagedRecord

    manifest = files.checksums
    try:
        truth = files.read_record(layer, expert)
    except DamagedRecord as exc:  # the model file no longer holds the record whole
        return [("L3", str(exc))]
    found = []
    if manifest is not None and files.layout.checksum(truth) != manifest.expected(layer, expert):
        found.append(("L3", f"the model file fails its checksum (crc32 {files.layout.checksum(truth):08x}, the "
                            f"manifest says {manifest.expected(layer, expert):08x}): "
                            f"{', '.join(str(f) for f in files.record_files(layer, expert))} is damaged"))
    if tier == "L2" and manifest is not None:
        if files.layout.checksum(got) != manifest.expected(layer, expert):
            found.append(("L2", "the copy in shared memory fails its checksum"))
    elif got != truth:
        found.append((tier, "differs from the model file"))
    return found


def run(args: argparse.Namespace) -> int:
    from moe_l2.client.connection import L2Client
    from moe_l2.client.pool import ExpertPool
    from moe_l2.model import DIRECT_IO, DamagedRecord, ModelFiles

    if args.samples < 1:
        print("moe-l2 verify: --samples must be at least 1", file=sys.stderr)
        return 2
    try:
        files = ModelFiles.open(resolve_model(args.model))
    except (OSError, ValueError) as exc:
        print(f"moe-l2 verify: {exc}", file=sys.stderr)
        return 1
    if args.manifest and files.checksums is None:
        return _write_manifest(files)
    if files.checksum_problem:
        print(f"moe-l2 verify: {files.checksum_problem}", file=sys.stderr)
    manifest = files.checksums
    client = None if args.no_daemon else L2Client(files, args.socket, wait_s=2.0)
    if client is not None and not client.attached:
        print(f"moe-l2 verify: not attached to moe-l2d ({client.last_error or 'no answer'}); "
              "checking the pread path only", file=sys.stderr)
    if args.all or args.manifest:
        picks = [(layer, expert) for layer in range(files.n_layers) for expert in range(files.n_experts)]
    else:
        rng = random.Random(args.seed)
        picks = [(rng.randrange(files.n_layers), rng.randrange(files.n_experts)) for _ in range(args.samples)]
    # verify compares every record itself, so that it reports damage instead of the pool refusing it.
    try:
        pool = ExpertPool(files, capacity=1, client=client, direct=DIRECT_IO[args.direct_io], verify="off")
    except (OSError, ValueError) as exc:  # a model file removed, or swapped for a FIFO, since the open
        if client is not None:
            client.close()
        print(f"moe-l2 verify: {exc}", file=sys.stderr)
        return 1
    tiers = {"L2": 0, "L3": 0}
    mismatches = {"L2": 0, "L3": 0}
    try:
        for layer, expert in picks:
            try:
                counts = pool.fetch(layer, [expert])
            except DamagedRecord as exc:  # the model file no longer holds the record whole
                tier, found = "L3", [("L3", str(exc))]
            else:
                tier = "L2" if counts.l2_hits else "L3"
                found = _problems(files, layer, expert, tier, pool.layers[layer].record(expert))
                # Evicted at once, so that every sample goes through L2 or L3, never L0.
                pool.evict(layer, expert)
            tiers[tier] += 1
            for where, problem in found:
                mismatches[where] += 1
                print(f"MISMATCH layer {layer} expert {expert} (from {where}): {problem}")
    finally:
        pool.close()
        if client is not None:
            client.close()
    checked = ("checksums checked against " + str(manifest.path) if manifest is not None else
               "no usable checksum manifest" if files.checksum_problem else
               "no checksum manifest (`moe-l2 verify --manifest` writes one)")
    total = sum(mismatches.values())
    print(f"checked {len(picks)} experts of {files.path} ({files.format}): {tiers['L2']} from L2 (shared memory), "
          f"{tiers['L3']} from L3 (model file); {checked}; {total} mismatches (L2 {mismatches['L2']}, "
          f"L3 {mismatches['L3']})")
    return 1 if total or files.checksum_problem else 0

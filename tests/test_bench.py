"""moe-l2 bench end to end at a tiny geometry: real client processes, a real moe-l2d, real files and, where this
machine can make one, a real memory cgroup; and the real geometries it builds."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from moe_l2.cache.trace import read_traces
from moe_l2.cli import main
from moe_l2.lab.busy import COPY_BYTES, busy_cores
from moe_l2.lab.random_models import make_model
from moe_l2.model import ModelFiles
from moe_l2.model.architecture import switch_layers
from moe_l2.model.checksums import manifest_path
from moe_l2.lab.synthetic import GEOMETRIES, build
from .conftest import segment_exists, synthetic_trace, wait_for

FIELDS = {"name": str, "budget_share": float, "processes": int, "stall_s_per_token": float,
          "tok_s_projected": float, "hit_rates": dict, "disk_bytes_per_token": float, "peak_bytes": int}


@pytest.fixture
def tiny(tmp_path):
    model = make_model(tmp_path / "model", arch="qwen3_moe", layers=2, experts=32, top_k=2, hidden_size=128,
                       moe_hidden_size=64, bits=4, seed=1)
    trace = synthetic_trace(tmp_path / "trace.jsonl.gz", n_layers=2, n_experts=32, top_k=2, seqs=4, tokens=15)
    return model, trace


def test_every_configuration_runs_and_its_counts_add_up(tiny, tmp_path, capsys):
    model, trace = tiny
    png = tmp_path / "bench.png"
    status = main(["bench", "--model", str(model), "--trace", str(trace), "--budget-share", "50%", "--processes", "2",
                   "--compute-ms", "0.1", "--warmup", "0", "--plot", str(png), "--json"])
    assert status == 0
    result = json.loads(capsys.readouterr().out)
    files = ModelFiles.open(model)
    record = files.layout.nbytes
    # Every token of the trace is replayed once (2 processes, half the sequences each, nothing warms up):
    # each layer's distinct picks are one L0 lookup.
    lookups = sum(len(set(layer)) for s in read_traces(trace).sequences for token in s.experts for layer in token)
    assert [c["name"] for c in result["configs"]] == ["page-cache", "pread", "moe-l2", "moe-l2+prefetch"]
    by_name = {c["name"]: c for c in result["configs"]}
    for c in result["configs"]:
        if "skipped" in c:
            assert c["name"] == "page-cache" and "cgroup" in c["skipped"], c  # no cgroup can be made here
            continue
        for key, kind in FIELDS.items():
            assert isinstance(c[key], kind), (c["name"], key)
        assert (c["budget_share"], c["processes"], c["tokens"]) == (0.5, 2, 60)
        counts = c["counts"]
        # A layer whose loan the daemon tore is fetched (looked up) again.
        assert counts["lookups"] == lookups + c["torn_lookups"] == counts["l0_hits"] + counts["l2_hits"] + counts["l3_reads"]
        assert counts["bytes_read"] == counts["l3_reads"] * record
        # L2 hits are computed on in place (lent) by default, copied otherwise.
        assert counts["bytes_copied"] == (counts["l2_hits"] - counts["l2_lent"]) * record
        assert c["hit_rates"]["L0"] == pytest.approx(counts["l0_hits"] / counts["lookups"])
        assert c["tok_s_projected"] == pytest.approx(1 / (2 * 0.1e-3 + c["stall_s_per_token"]))
        # Each lookup once, by where its bytes came from (TierCounts.by_source): a record the daemon read while the
        # lookup waited is a disk read, not an L2 hit.
        assert c["tiers"] == {"l0": counts["l0_hits"], "l2": counts["l2_hits"] - counts["l2_awaited"],
                              "daemon_disk": counts["l2_awaited"], "own_disk": counts["l3_reads"]}
        assert c["peak_bytes"] > 0
    pread, moe = by_name["pread"], by_name["moe-l2"]
    # pread: the whole budget as L0, direct reads, so the kernel read at least what the pool read from the files.
    # The budget is a share of the records; a row takes its record on a page.
    assert pread["l0_experts"] == int(0.5 * 2 * 32 * record) // 2 // (2 * files.layout.stride)
    assert pread["counts"]["l2_hits"] == 0 and pread["l2_slots"] == 0 and pread["hit_rates"]["L2"] is None
    assert pread["disk_bytes"] >= pread["counts"]["bytes_read"] > 0
    # moe-l2: every L0 miss is looked up in L2, and the daemon's L2 served some of them.
    assert moe["counts"]["l2_lookups"] == lookups + moe["torn_lookups"] - moe["counts"]["l0_hits"]
    assert moe["l2_slots"] >= 1 and moe["counts"]["l2_hits"] > 0 and moe["counts"]["l2_lent"] > 0
    # In-place reads: top-k rows in all, the rest of the memory L2's.
    assert moe["l0_experts"] == files.top_k and moe["l0_shared"]
    # Fills (the default): the clients read their misses themselves and gave them to L2; a record one of them found
    # on its way (the other's gift) it waited for on its slot (one that landed before the wait began is copied
    # without a sleep), and such waits are counted, each woken or expired.
    assert moe["counts"]["l3_reads"] > 0 and set(moe["waits"]) == {"waits", "woken", "expired", "waited_s"}
    assert moe["waits"]["woken"] + moe["waits"]["expired"] == moe["waits"]["waits"]
    assert moe["waits"]["waits"] == 0 or moe["waits"]["waited_s"] > 0
    # L2's own hits: held when looked up, not waited for.
    assert moe["hit_rates"]["L2"] == pytest.approx((moe["counts"]["l2_hits"] - moe["counts"]["l2_awaited"])
                                                   / moe["counts"]["l2_lookups"])
    # moe-l2+prefetch: each token's layer 0 guessed layer 1 (the last layer guesses nothing), and the guesses
    # were scored against every pick of layer 1; the demand counts above stay consistent with prefetch on.
    ahead = by_name["moe-l2+prefetch"]["prefetch"]
    assert ahead["requests"] == 60 and ahead["guessed"] == 60 * files.top_k
    assert ahead["picked"] == sum(len(set(t[1])) for s in read_traces(trace).sequences for t in s.experts)
    # With moe-l2's shared L0 the guesses L2 lacks are asked of the daemon, each scored at layer 1's next fetch.
    assert by_name["moe-l2+prefetch"]["l0_shared"]
    assert 0 < ahead["issued"] and ahead["useful"] + ahead["wasted"] == ahead["issued"]
    assert moe["prefetch"] is None
    if "skipped" not in by_name["page-cache"]:
        pc = by_name["page-cache"]
        assert pc["l0_experts"] == files.top_k and 0 <= pc["hit_rates"]["page_cache"] <= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeat_takes_turns_and_reports_medians_in_their_range_and_ratios_pair_by_pair(tiny, capsys, monkeypatch):
    from moe_l2.cli import bench

    model, trace = tiny
    order = []
    real = bench.run_config

    def run_config(files, config, *rest):
        order.append(config)
        return real(files, config, *rest)

    monkeypatch.setattr(bench, "run_config", run_config)
    configs = ["pread", "moe-l2", "moe-l2+prefetch"]
    assert main(["bench", "--model", str(model), "--trace", str(trace), "--budget-share", "50%", "--processes", "1",
                 "--compute-ms", "0", "--warmup", "0", "--tokens", "8", "--configs", ",".join(configs),
                 "--repeat", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert order == configs * 3 and result["repeat"] == 3
    by_name = {c["name"]: c for c in result["configs"]}
    for c in result["configs"]:
        runs = c["runs"]
        assert len(runs) == 3
        for figure in ("stall_s_per_token", "tok_s_projected", "disk_bytes_per_token", "peak_bytes"):
            values = [r[figure] for r in runs]
            assert c["spread"][figure] == [min(values), max(values)]
            assert min(values) <= c[figure] <= max(values) and c[figure] == sorted(values)[1]
        # Counts add up over the runs: each replayed the same 8 tokens.
        assert c["tokens"] == 3 * 8
        counts = c["counts"]
        assert counts["lookups"] == sum(c["tiers"].values()) == counts["l0_hits"] + counts["l2_hits"] + counts["l3_reads"]
    # Each against pread, and the variant against what it varies, moe-l2: run i with run i.
    ratios = {(r["name"], r["against"]): r for r in result["ratios"]}
    assert set(ratios) == {("moe-l2", "pread"), ("moe-l2+prefetch", "pread"), ("moe-l2+prefetch", "moe-l2")}
    for (name, against), ratio in ratios.items():
        pairs = [m["tok_s_projected"] / p["tok_s_projected"]
                 for m, p in zip(by_name[name]["runs"], by_name[against]["runs"])]
        assert ratio["pairs"] == pytest.approx(pairs) and len(pairs) == 3
        assert ratio["min"] <= ratio["median"] <= ratio["max"] and ratio["median"] == pytest.approx(sorted(pairs)[1])


def test_cold_warm_scenario_a_new_process_finds_what_the_first_left_in_l2(tiny, capsys):
    model, trace = tiny
    # The whole budget: L2 holds every record the tokens touch, so what the first process read, the second finds.
    assert main(["bench", "--model", str(model), "--trace", str(trace), "--budget-share", "100%", "--processes",
                 "1", "--compute-ms", "0", "--tokens", "8", "--configs", "moe-l2", "--scenario", "cold-warm",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    cold, warm, new = result["configs"]
    assert [c["phase"] for c in (cold, warm, new)] == ["cold", "warm", "new process"]
    tokens = [t for s in read_traces(trace).sequences for t in s.experts][:8]
    records = {(layer, e) for t in tokens for layer, picks in enumerate(t) for e in picks}
    lookups = sum(len(set(picks)) for t in tokens for picks in t)
    for c in (cold, warm, new):
        assert c["tokens"] == 8 and c["first_token_s"] > 0
        assert c["counts"]["lookups"] == lookups + c["torn_lookups"] == sum(c["tiers"].values())
    # Cold: each record the tokens touch came from the disk, read by the client itself (fills, the default), at
    # least once: with no compute between layers a record can be missed again before its donation is in L2, and is
    # read again or waited for on its way (daemon_disk: a donation whose row was taken first, which the daemon
    # reads). Then the same process again, and a new one, find every L0 miss held in L2.
    assert cold["tiers"]["own_disk"] >= len(records)
    for c in (warm, new):
        assert c["tiers"]["daemon_disk"] == c["tiers"]["own_disk"] == 0
        assert c["tiers"]["l2"] == c["counts"]["lookups"] - c["tiers"]["l0"] > 0 and c["hit_rates"]["L2"] == 1.0


def test_copied_l2_reads_give_l0_half_the_budget(tiny, capsys):
    model, trace = tiny
    assert main(["bench", "--model", str(model), "--trace", str(trace), "--budget-share", "50%", "--processes", "1",
                 "--compute-ms", "0", "--warmup", "0", "--configs", "moe-l2", "--l2-reads", "copy", "--json"]) == 0
    moe = json.loads(capsys.readouterr().out)["configs"][0]
    files = ModelFiles.open(model)
    assert moe["l0_experts"] == int(0.5 * 0.5 * 2 * 32 * files.layout.nbytes) // (2 * files.layout.stride)
    assert moe["counts"]["l2_lent"] == 0 and moe["counts"]["l2_hits"] > 0
    assert moe["counts"]["bytes_copied"] == moe["counts"]["l2_hits"] * files.layout.nbytes


def test_autopin_runs_beside_moe_l2_with_the_same_per_layer_l0_or_says_how(tiny, capsys):
    model, trace = tiny
    run = ["bench", "--model", str(model), "--trace", str(trace), "--budget-share", "50%", "--processes", "1",
           "--compute-ms", "0", "--warmup", "0", "--tokens", "8", "--json"]
    # moe-l2's L0 is shared by default here: nothing runs, and the command says how to run it.
    assert main([*run, "--configs", "moe-l2+autopin"]) == 1
    assert "--l2-reads copy" in capsys.readouterr().err
    assert main([*run, "--configs", "moe-l2,moe-l2+autopin", "--l2-reads", "copy"]) == 0
    result = json.loads(capsys.readouterr().out)
    moe, autopin = result["configs"]
    assert not moe["l0_shared"] and not autopin["l0_shared"] and moe["l0_experts"] == autopin["l0_experts"]
    assert autopin["counts"]["lookups"] == moe["counts"]["lookups"]
    assert {(r["name"], r["against"]) for r in result["ratios"]} >= {("moe-l2+autopin", "moe-l2")}


def test_a_budget_under_top_k_and_a_mismatched_trace_say_what_to_do(tiny, tmp_path, capsys):
    model, trace = tiny
    # --budget, bench's name for --budget-share until this release, still works and says so.
    assert main(["bench", "--model", str(model), "--trace", str(trace), "--budget", "5%", "--processes", "1"]) == 1
    err = capsys.readouterr().err
    assert "--budget is deprecated" in err and "use --budget-share" in err
    assert "top-2" in err and "raise --budget-share" in err
    # The toy trace routes 32 experts, top-2; gpt-oss-20b has 32, top-4: refused before anything is built.
    assert main(["bench", "--geometry", "gpt-oss-20b", "--trace", str(trace), "--cache-dir", str(tmp_path)]) == 1
    assert "pass the geometry of the trace's model" in capsys.readouterr().err
    assert not list(tmp_path.glob("gpt-oss-20b*"))


def test_busy_cores_spin_beside_the_runs_and_are_stated(tiny, capsys):
    model, trace = tiny
    assert main(["bench", "--model", str(model), "--trace", str(trace), "--budget-share", "50%", "--processes", "1",
                 "--configs", "pread", "--busy-cores", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["busy_cores"] == 2 and result["load_average"] >= 0
    assert not [p for p in psutil.Process().children(recursive=True) if "moe_l2.lab.busy" in p.cmdline()]
    assert main(["bench", "--model", str(model), "--trace", str(trace), "--busy-cores", "-1"]) == 1
    assert "--busy-cores must be 0 or more" in capsys.readouterr().err


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_busy_core_spins_until_its_block_ends_or_its_parent_dies():
    with busy_cores(2) as spinners:
        wait_for(lambda: all(psutil.Process(s.pid).cpu_times().user > 0.2 for s in spinners), 30,
                 "the spinners' CPU time")
    assert all(s.returncode is not None for s in spinners)
    # A bench killed outright: its spinner sees its parent go, and ends.
    parent = subprocess.Popen([sys.executable, "-c", "import time\nfrom moe_l2.lab.busy import busy_cores\n"
                               "with busy_cores(1) as (s,):\n    print(s.pid, flush=True)\n    time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    with parent.stdout:
        pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    wait_for(lambda: _gone(pid), 30, "the end of the spinner whose parent died")


def test_a_copying_core_copies_through_memory_until_its_block_ends():
    with busy_cores(1, copying=True) as (spinner,):
        process = psutil.Process(spinner.pid)
        # Between its fork and its exec a spinner's command line is its parent's, or empty.
        wait_for(lambda: process.cmdline()[-1:] == ["copying"], 30, "the copying spinner's exec")
        # Its two buffers, written: more than the cache of the CPU it runs on.
        wait_for(lambda: process.cpu_times().user > 0.2 and process.memory_info().rss > 2 * COPY_BYTES, 30,
                 "the copying spinner's CPU time and buffers")
    assert spinner.returncode is not None


def test_the_old_name_of_first_layers_still_works_and_is_hidden(capsys):
    from moe_l2.cli import build_parser

    parser = build_parser("bench")
    args = parser.parse_args(["bench", "--trace", "t.jsonl", "--layers", "6"])
    assert args.first_layers == 6 and "--layers is deprecated" in capsys.readouterr().err
    assert parser.parse_args(["bench", "--trace", "t.jsonl", "--first-layers", "6"]).first_layers == 6
    assert not capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--help"])
    shown = capsys.readouterr().out
    assert "--first-layers" in shown and "--budget-share" in shown
    assert "--layers " not in shown and "--budget " not in shown


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_each_real_geometry_is_what_mlx_lm_builds_for_its_config(name):
    geometry = GEOMETRIES[name]
    switches = switch_layers(geometry.config_for(2))
    assert len(switches) == 2
    assert {(s.n_experts, s.top_k) for s in switches} == {(geometry.n_experts, geometry.top_k)}
    assert {p.split(".")[0] for p, *_ in geometry.pieces()} == set(switches[0].projections)


def test_a_built_geometry_is_a_packed_model_of_its_pieces(tmp_path):
    # The deepseek-v2-lite geometry scaled down (the real one writes 300 MiB a layer): same code path.
    small = dataclasses.replace(GEOMETRIES["deepseek-v2-lite"], hidden=256, moe_hidden=128)
    small = dataclasses.replace(small, config=dict(small.config, hidden_size=256, moe_intermediate_size=128))
    path = build(small, 2, tmp_path)
    files = ModelFiles.open(path)
    assert (files.format, files.n_layers, files.n_experts, files.top_k) == ("packed", 2, 64, 6)
    assert [(p.key, p.shape, p.dtype) for p in files.layout.pieces] == [
        (p.key, p.shape, p.dtype) for p in small.layout().pieces]
    # Records are the file's bytes where the layout says; a second build reuses the directory.
    f, start, span = files.record_span(1, 5)
    with open(files.files[f], "rb") as fh:
        fh.seek(start)
        raw = fh.read(files.layout.nbytes)
    assert files.read_record(1, 5) == raw and len(set(raw)) > 200
    # It has the manifest `moe-l2 pack` writes, so that readers check its records as they check a user's.
    assert files.checksums.expected(1, 5) == files.layout.checksum(raw)
    mtime = (path / "config.json").stat().st_mtime_ns
    assert build(small, 2, tmp_path) == path and (path / "config.json").stat().st_mtime_ns == mtime
    # One built before manifests gets it at its next use, the records left as they are.
    manifest_path(path).unlink()
    assert build(small, 2, tmp_path) == path and (path / "config.json").stat().st_mtime_ns == mtime
    assert ModelFiles.open(path).checksums == files.checksums and files.read_record(1, 5) == raw


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE  # a zombie has exited
    except psutil.NoSuchProcess:
        return False


def _described(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid}: {' '.join(proc.cmdline())}"
    except psutil.NoSuchProcess:  # it ended (a zombie included) since it was seen alive
        return f"{proc.pid}: ended"


def _started(bench: psutil.Process, module: str) -> list[psutil.Process]:
    found = []
    for child in bench.children(recursive=True):
        try:
            if module in child.cmdline():
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _listed_segments(daemon: psutil.Process) -> list[str]:
    """The segments the daemon lists in its runtime dir (moe-l2d-*.segments), once it serves."""
    args = daemon.cmdline()
    runtime_dir = Path(args[args.index("--runtime-dir") + 1])
    names = []
    for state in runtime_dir.glob("moe-l2d-*.segments"):
        try:
            names += json.loads(state.read_text())
        except (OSError, ValueError):
            continue  # being written
    return names


@pytest.mark.slow
@pytest.mark.parametrize("config, how", [("moe-l2", "ctrl-c"), ("moe-l2", "sigterm"), ("moe-l2", "sigkill"),
                                         ("page-cache", "sigkill")])
def test_an_interrupted_bench_leaves_nothing_behind(tiny, tmp_path, config, how):
    model, trace = tiny
    log = tmp_path / "bench.err"
    # Compute long enough that the replay is still running when the bench is stopped; its own session, so that
    # a Ctrl-C can reach its whole process group as a terminal's does, and nothing else.
    with log.open("wb") as err:
        bench = subprocess.Popen([sys.executable, "-P", "-m", "moe_l2.cli", "bench", "--model", str(model), "--trace",
                                  str(trace), "--budget-share", "50%", "--processes", "2", "--compute-ms", "1000",
                                  "--configs", config, "--json"], stdout=subprocess.DEVNULL, stderr=err,
                                 start_new_session=True)
    try:
        parent = psutil.Process(bench.pid)
        cgroups = [root / f"moe-l2-bench-{bench.pid}"
                   for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory"))]
        # Up: both clients started and, for moe-l2, its daemon serving (it lists its segments once it does).
        wait_for(lambda: len(_started(parent, "moe_l2.lab.replayer")) == 2 or bench.poll() is not None,
                 60, "the bench's client processes")
        if bench.poll() is not None:
            err = log.read_text()
            assert config == "page-cache" and "cgroup" in err, err
            pytest.skip(f"no memory cgroup here: {err}")
        segments = []
        if config == "moe-l2":
            (daemon,) = _started(parent, "moe_l2.daemon.main")
            wait_for(lambda: _listed_segments(daemon), 60, "the daemon's segments")
            segments = _listed_segments(daemon)
            assert all(segment_exists(name) for name in segments)
        else:
            assert any(c.is_dir() for c in cgroups)
        started = parent.children(recursive=True)
        if how == "ctrl-c":
            os.killpg(bench.pid, signal.SIGINT)
        else:
            bench.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        status = bench.wait(60)
        err = log.read_text()
        assert status == {"ctrl-c": 130, "sigterm": 143, "sigkill": -signal.SIGKILL}[how], err
        if how != "sigkill":
            assert "stopped by" in err and "Traceback" not in err, err
        # Killed outright, the bench removed nothing: its children saw it die and end (the daemon unlinking its
        # segments as it does on SIGTERM), and the cgroup's keeper removes the group once they have.
        wait_for(lambda: not any(_alive(p) for p in started), 60, "the end of the bench's children",
                 detail=lambda: "\n".join(_described(p) for p in started if _alive(p)))
        wait_for(lambda: not any(segment_exists(name) for name in segments), 30, "the segments' unlinking")
        if sys.platform == "linux":
            assert not {name.lstrip("/") for name in segments} & {p.name for p in Path("/dev/shm").iterdir()}
        wait_for(lambda: not any(c.exists() for c in cgroups), 30, "the cgroup's removal")
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()


def test_load_through_runs_beside_moe_l2_which_fills(tiny, capsys):
    """moe-l2 gives its misses to L2 (fills, the default); moe-l2+load-through, as a process of another user runs,
    waits for the daemon's loads instead: the same lookups, compared run by run."""
    model, trace = tiny
    assert main(["bench", "--model", str(model), "--trace", str(trace), "--budget-share", "50%", "--processes", "1",
                 "--compute-ms", "0", "--warmup", "0", "--tokens", "8", "--configs", "moe-l2,moe-l2+load-through",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    moe, through = result["configs"]
    # moe-l2 reads its misses itself. It waits only for a record already on its way into L2: one it gave whose row
    # the next lookup took before the copy, which the daemon then reads (client/donor.py). On a loaded machine a
    # few are; load-through waits for every miss L2 lacks.
    assert moe["counts"]["l3_reads"] > 0 and moe["counts"]["l2_awaited"] < through["counts"]["l2_awaited"]
    assert through["l0_experts"] == moe["l0_experts"]
    assert through["counts"]["lookups"] == moe["counts"]["lookups"]
    assert {(r["name"], r["against"]) for r in result["ratios"]} >= {("moe-l2+load-through", "moe-l2")}

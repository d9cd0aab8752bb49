"""Fast checks of benchmarks/: the models' shapes and sizes, the drivers' plumbing, and one tiny
real run of each driver with Horovod+Gloo at 2 ranks (skipped where Horovod is not installed).

FastHorovod itself is not needed here: the benchmarks exercise its backends, these tests do not.
"""
import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    """Import benchmarks/<name>.py without putting benchmarks/ on sys.path for the whole session:
    the scripts import each other by plain name (``import _common``), so benchmarks/ is on the path
    while one loads, and the plain names it added to sys.modules are removed afterwards."""
    spec = importlib.util.spec_from_file_location(f"_benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    before = set(sys.modules)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
        for added in set(sys.modules) - before:
            if getattr(sys.modules[added], "__file__", None) and \
                    Path(sys.modules[added].__file__).parent == BENCHMARKS:
                del sys.modules[added]
    return module


models = _load("models")
common = _load("_common")
train = _load("train")
allreduce = _load("allreduce")


@pytest.mark.parametrize("name, expected", [("alexnet", 61_100_840), ("vgg16", 138_357_544)])
def test_parameter_counts_match_torchvision(name, expected):
    model = models.build_model(name, num_classes=1000)
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize("name", ["alexnet", "vgg16"])
@pytest.mark.parametrize("image_size", [models.MIN_IMAGE_SIZE, 70])
def test_forward_shape_at_small_images(name, image_size):
    model = models.build_model(name, num_classes=10).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, image_size, image_size))
    assert out.shape == (2, 10)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="alexnet"):
        models.build_model("resnet50")


def test_train_compute_phase_can_be_skipped():
    assert train.parse_args(["--compute-steps", "0"]).compute_steps == 0
    assert train.parse_args([]).compute_steps == 3
    for bad in (["--compute-steps", "-1"], ["--steps", "0"], ["--image-size", "16"]):
        with pytest.raises(SystemExit):
            train.parse_args(bad)


def test_sizes_parse_and_format():
    """The package's units (fasthorovod/units.py): binary KiB/MiB, decimal MB, a bare M refused."""
    assert [common.parse_size(s) for s in ("4096", "64KiB", "1MiB", "1MB", "256MiB")] == \
        [4096, 65536, 1 << 20, 10**6, 256 << 20]
    assert common.format_size(65536) == "64KiB" and common.format_size(1000) == "1000B"
    for bad, message in (("12 parsecs", "unknown unit 'parsecs'"), ("1M", "ambiguous: write 1MiB")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            common.parse_size(bad)
    for script in (allreduce, sweep):
        with pytest.raises(SystemExit):
            script.parse_args(["--sizes" if script is allreduce else "--size", "64M"])


def test_backend_specs():
    assert common.parse_backend("horovod") == common.Backend("horovod", "horovod-gloo")
    assert common.parse_backend("fasthorovod:4").count == 4
    assert common.parse_backend("mpi4py:2").count == 2
    train_kinds = ("horovod-gloo", "horovod-mpi", "fasthorovod")
    assert common.parse_backend("fasthorovod:4:odsgd", train_kinds, True).algorithm == "odsgd"
    traced = common.parse_backend("fasthorovod:4:odsgd+trace", train_kinds, True)
    assert (traced.count, traced.algorithm, traced.trace) == (4, "odsgd", True)
    assert common.backend_env(traced, trace_root="/r") == {
        "FASTHOROVOD_TRACE_DIR": "/r/fasthorovod_4_odsgd_trace", "FASTHOROVOD_NUM_LANES": "4"}
    assert "FASTHOROVOD_TRACE_DIR" not in common.backend_env(common.parse_backend("fasthorovod:4"))
    repo = str(BENCHMARKS.parent)
    other = common.parse_backend(f"fasthorovod:4@{repo}")
    assert (other.count, other.source) == (4, repo)
    assert common.backend_env(other)["PYTHONPATH"].split(os.pathsep)[0] == repo
    # another checkout may predate the lane settings' names: it gets their former names too
    assert {k: v for k, v in common.backend_env(common.parse_backend(f"fasthorovod:4x2@{repo}")).items()
            if k != "PYTHONPATH"} == {"FASTHOROVOD_NUM_LANES": "4", "FASTHOROVOD_SOCKETS_PER_LANE": "2",
                                      "FASTHOROVOD_NUM_PROXIES": "4", "FASTHOROVOD_SOCKETS_PER_PROXY": "2"}
    for bad in ("nccl", "torch-fasthorovod:2", "torch-gloo:2x2", "fasthorovod:0", "fasthorovod:4:odsgd", "horovod+trace",
                "horovod@" + repo, "fasthorovod:4@/nonexistent", "fasthorovod:4x0", "fasthorovod:4x",
                "fasthorovod:x2", "fasthorovod:0x2", "mpi4py:2x2", "fasthorovod:4X2"):
        with pytest.raises(ValueError):
            common.parse_backend(bad)


def test_fp16_suffix_is_horovods_compressor_for_both_apis_bf16_fasthorovods():
    assert common.parse_backend("fasthorovod+fp16").compression == common.parse_backend("horovod+fp16").compression == "fp16"
    assert common.parse_backend("fasthorovod+bf16").compression == "bf16"
    assert common.parse_backend("fasthorovod").compression is None
    with pytest.raises(ValueError, match="only horovod and fasthorovod backends take \\+fp16"):
        common.parse_backend("torch-gloo+fp16")
    with pytest.raises(ValueError, match="only fasthorovod backends take \\+bf16"):
        common.parse_backend("horovod+bf16")
    with pytest.raises(ValueError, match="one compression at most"):
        common.parse_backend("fasthorovod+fp16+bf16")
    expected = torch.full((8,), 10000.0)  # 10000 is not a float16 value: 9999.9 would not be either
    allreduce.check(torch.full((8,), 10000.0 * (1 + 2.0 ** -9)), expected, "sum", 0, 32, 0, compression="fp16")
    with pytest.raises(RuntimeError, match="wrong sum allreduce"):
        allreduce.check(torch.full((8,), 10100.0), expected, "sum", 0, 32, 0, compression="fp16")


def test_flat_and_hierarchical_suffixes():
    flat = common.parse_backend("fasthorovod:4x2+flat")
    assert (flat.count, flat.sockets, flat.flat) == (4, 2, True)
    assert common.backend_env(flat)["FASTHOROVOD_HIERARCHICAL"] == "0"
    assert common.backend_env(common.parse_backend("fasthorovod+trace+flat"), trace_root="/r")[
        "FASTHOROVOD_HIERARCHICAL"] == "0"
    assert common.backend_env(common.parse_backend("horovod+hierarchical")) == {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}
    assert common.parse_backend("horovod-mpi+hierarchical").hierarchical
    for bad, message in (("horovod+flat", "only fasthorovod backends take \\+flat"),
                         ("fasthorovod+hierarchical", "on by default"), ("fasthorovod+fast", "unknown suffix")):
        with pytest.raises(ValueError, match=message):
            common.parse_backend(bad)


def test_sockets_per_lane_spec_and_plain_fasthorovod_sets_nothing():
    grid = common.parse_backend("fasthorovod:4x2")
    assert (grid.kind, grid.count, grid.sockets) == ("fasthorovod", 4, 2)
    assert common.backend_env(grid) == {"FASTHOROVOD_NUM_LANES": "4",
                                        "FASTHOROVOD_SOCKETS_PER_LANE": "2"}
    assert common.backend_env(common.parse_backend("fasthorovod:8")) == {"FASTHOROVOD_NUM_LANES": "8"}
    # FastHorovod's defaults: no FASTHOROVOD_* variable at all
    assert common.backend_env(common.parse_backend("fasthorovod")) == {}
    with_algorithm = common.parse_backend("fasthorovod:2x4:odsgd+trace", with_algorithm=True)
    assert (with_algorithm.count, with_algorithm.sockets, with_algorithm.algorithm,
            with_algorithm.trace) == (2, 4, "odsgd", True)


def test_data_plane_label():
    assert common.data_plane_label(None) == "-"
    assert common.data_plane_label({"lanes": 4, "sockets_per_lane": 2, "sockets_source": "probe"}) == \
        "4x2 (probe)"
    assert common.data_plane_label({"lanes": 8, "sockets_per_lane": 1,
                                    "sockets_source": "FASTHOROVOD_SOCKETS_PER_LANE"}) == "8x1 (set)"
    assert common.data_plane_label({"lanes": 8, "sockets_per_lane": 1,  # a record from before the rename
                                    "sockets_source": "FASTHOROVOD_SOCKETS_PER_PROXY"}) == "8x1 (set)"
    assert common.data_plane_label({"lanes": 4, "sockets_per_lane": 1,
                                    "sockets_source": "default (one host: no probe)"}) == "4x1 (default)"
    assert common.data_plane_label({"lanes": 4, "sockets_per_lane": 1, "sockets_source": "probe",
                                    "hierarchical": {"hosts": 3, "ranks_per_host": 2}}) == "4x1 (probe), hier 3x2"


@pytest.mark.parametrize("spec, mode", [("horovod-gloo", "--gloo"), ("fasthorovod:4", "--gloo"),
                                        ("torch-gloo", "--gloo"), ("horovod-mpi", "--mpi"),
                                        ("mpi4py:4", "--mpi")])
def test_launcher_prefix_starts_every_backend(spec, mode):
    prefix = ["fasthorovodrun", "--emulate-cloud", "4:1gbit:200mbit"]
    (process,) = common.build_launch(common.parse_backend(spec), 4, ["python", "w.py"], prefix)
    assert Path(process.argv[0]).name == prefix[0]  # resolved to a path where installed
    assert process.argv[1:3] == prefix[1:]
    assert process.argv[3:6] == [mode, "-np", "4"]
    assert process.argv.index("python") > 5


def test_native_mpi_launch_keeps_traffic_on_tcp():
    (process,) = common.build_launch(common.parse_backend("mpi4py:4"), 2, ["python", "w.py"])
    line = " ".join(process.argv)
    assert "--mca btl tcp,self" in line and "--mca btl_tcp_links 4" in line
    assert "--mca pml ob1" in line


def test_torch_gloo_spawns_one_process_per_rank():
    processes = common.build_launch(common.parse_backend("torch-gloo"), 3, ["python", "w.py"])
    assert [p.env["RANK"] for p in processes] == ["0", "1", "2"]
    assert len({p.env["MASTER_PORT"] for p in processes}) == 1


def _run_driver(script, args, tmp_path, timeout=150):
    out, plot = tmp_path / "result.json", tmp_path / "result.png"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args, "--out", str(out),
                           "--plot", str(plot)], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return json.loads(out.read_text()), plot, proc.stdout


def test_missing_launcher_is_skipped_not_a_crash(tmp_path):
    report, _, stdout = _run_driver(
        "allreduce.py", ["--np", "2", "--backends", "horovod-gloo", "--sizes", "4KiB",
                         "--launcher-prefix", "no-such-launcher --flag"], tmp_path)
    (entry,) = report["backends"]
    assert entry["status"] == "skipped" and "no-such-launcher" in entry["reason"]
    assert "skipped" in stdout


def _require_horovod():
    pytest.importorskip("horovod.torch", reason="Horovod is not installed (scripts/setup_env.sh)")


@pytest.mark.multiproc
def test_allreduce_driver_end_to_end(tmp_path):
    _require_horovod()
    report, plot, stdout = _run_driver(
        "allreduce.py", ["--np", "2", "--backends", "horovod-gloo", "--sizes", "64KiB,1MiB",
                         "--iters", "3", "--warmup", "1", "--timeout", "100", "--rounds", "2"],
        tmp_path)
    (entry,) = report["backends"]
    assert entry["status"] == "ok", entry
    results = entry["result"]["results"]
    assert [r["bytes"] for r in results] == [64 << 10, 1 << 20]
    assert all(r["verified"] and r["busbw_gbps"] > 0 and r["p90_s"] > 0 and r["median_s"] > 0
               for r in results)
    # two rounds, each kept; the reported median is the median of the rounds' medians
    assert len(entry["rounds"]) == 2 and all(e["status"] == "ok" for e in entry["rounds"])
    for i, r in enumerate(results):
        per_round = [e["result"]["results"][i]["median_s"] for e in entry["rounds"]]
        assert r["round_medians_s"] == per_round
        assert r["median_s"] == pytest.approx(sum(per_round) / 2)
    assert report["machine"]["cores"] >= 1 and report["args"]["np"] == 2
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "1MiB" in stdout


@pytest.mark.parametrize("collective,nbytes", [("reducescatter", 4100), ("allgather", 8200), ("alltoall", 8200)])
def test_collective_drivers_end_to_end(tmp_path, collective, nbytes):
    """--collective reducescatter / allgather / alltoall: every rank's result checked (an odd count
    splits a reduce-scatter unevenly; an allgather's and an alltoall's bit for bit), the bus
    bandwidth (N-1)/N of the bytes per second, FastHorovod next to Horovod; a backend without the
    collective is skipped, not a crash."""
    _require_horovod()
    report, _, _ = _run_driver(
        "allreduce.py", ["--np", "2", "--collective", collective, "--backends",
                         "horovod-gloo,fasthorovod,torch-gloo", "--sizes", str(nbytes), "--proxy-threshold", "0",
                         "--iters", "2", "--warmup", "1", "--timeout", "100"], tmp_path)
    horovod, ours, gloo = report["backends"]
    assert horovod["status"] == "ok" and ours["status"] == "ok", report["backends"]
    assert gloo["status"] == "skipped", gloo
    for entry in (horovod, ours):
        (r,) = entry["result"]["results"]
        assert r["verified"] and r["bytes"] == nbytes and entry["result"]["collective"] == collective
        assert r["busbw_gbps"] == pytest.approx(0.5 * nbytes * 8 / r["median_s"] / 1e9)
    assert ours["result"]["data_plane"] is not None


def test_torch_distributed_backends_end_to_end(tmp_path):
    """torch-gloo with Gloo's several-device workaround (one more connection per rank) and
    FastHorovod's torch.distributed backend, its proxies running, next to plain torch-gloo."""
    report, _, _ = _run_driver(
        "allreduce.py", ["--np", "2", "--backends", "torch-gloo,torch-gloo:2,torch-fasthorovod", "--sizes", "64KiB",
                         "--proxy-threshold", "0", "--iters", "2", "--warmup", "1", "--timeout", "100"], tmp_path)
    gloo, two, ours = report["backends"]
    for entry in (gloo, two, ours):
        assert entry["status"] == "ok" and entry["result"]["results"][0]["verified"], entry
    assert all(d > g for d, g in zip(two["result"]["tcp_connections"], gloo["result"]["tcp_connections"]))  # rank by rank
    assert gloo["result"]["data_plane"] is None and ours["result"]["data_plane"]["lanes"] >= 1


@pytest.mark.multiproc
def test_train_driver_end_to_end(tmp_path):
    _require_horovod()
    report, plot, stdout = _run_driver(
        "train.py", ["--np", "2", "--backends", "horovod", "--model", "alexnet",
                     "--image-size", "32", "--batch-size", "2", "--num-classes", "10",
                     "--steps", "1", "--warmup-steps", "0", "--compute-steps", "1",
                     "--timeout", "100"], tmp_path)
    (entry,) = report["backends"]
    assert entry["status"] == "ok", entry
    result = entry["result"]
    assert result["np"] == 2 and result["images_per_s"] > 0 and result["rounds"] == 1
    (job,) = entry["rounds"]
    assert len(job["result"]["weights_sha256"]) == 64
    assert len(job["result"]["step_times_s"]) == 1 and len(job["result"]["compute_times_s"]) == 1
    exposed = result["exposed_comm"]
    assert exposed["pairs"] == 1
    difference = job["result"]["step_times_s"][0] - job["result"]["compute_times_s"][0]
    assert exposed["measurable"] == (difference > 0)
    if result["exposed_comm_s"] is not None:
        assert difference > 0 and result["exposed_comm_s"] == pytest.approx(difference)
    _assert_no_negative_exposed_time(report)
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "1.00x" in stdout and "round 1/1, backend horovod:" in stdout
    timeline = job["timeline"]  # the job's start-up, phase by phase (every rank's clock in the JSON)
    assert len(job["result"]["rank_clocks"]) == 2
    assert min(timeline[name] for name, _ in train.STARTUP_PHASES + train.LATER_PHASES) >= 0
    assert timeline["startup"] == pytest.approx(sum(timeline[name] for name, _ in train.STARTUP_PHASES), abs=0.05)
    assert timeline["startup"] + timeline["steps"] + timeline["finish"] <= job["seconds"] + 0.2
    assert "start-up " in stdout and "broadcast_parameters " in stdout


@pytest.mark.multiproc
@pytest.mark.slow
def test_convergence_driver_end_to_end(tmp_path):
    pytest.importorskip("sklearn", reason="scikit-learn is not installed")
    _require_horovod()
    report, plot, stdout = _run_driver(
        "convergence.py", ["--np", "2", "--backends", "fasthorovod:1:ssgd,fasthorovod:1:cd-sgd",
                           "--epochs", "2", "--hidden", "64", "--hidden-layers", "1",
                           "--timeout", "100"], tmp_path)
    assert [e["backend"] for e in report["backends"]] == ["fasthorovod:1:ssgd",
                                                          "fasthorovod:1:cd-sgd"]
    summary = report["time_to_accuracy"]
    ssgd, cdsgd = report["backends"]
    for entry, algorithm in ((ssgd, "ssgd"), (cdsgd, "cd-sgd")):
        assert entry["status"] == "ok", entry
        result = entry["result"]
        assert result["algorithm"] == algorithm and result["np"] == 2
        curve = result["curve"]
        assert [p["epoch"] for p in curve] == [1, 2]
        assert all(0 <= p["accuracy"] <= 1 for p in curve)
        assert 0 < curve[0]["train_s"] <= curve[1]["train_s"] == result["train_s"]
        assert result["final_accuracy"] == curve[-1]["accuracy"]
        assert result["communication"]["bytes_per_step"] > 0
        assert "reached" in entry["time_to_target"] and "vs_first" in entry
    # The target is the first backend's final accuracy, which it reaches by definition.
    assert summary["target"] == ssgd["result"]["final_accuracy"]
    assert ssgd["time_to_target"]["reached"]
    assert ssgd["vs_first"]["time_ratio"] == pytest.approx(1.0)
    assert cdsgd["result"]["options"] == {"algorithm": "cd-sgd", "warmup_steps": 20,
                                          "threshold": 0.005}
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "time to target" in stdout


# --------------------------------------------------------------------------------------------
# repeat_train.py

repeat_train = _load("repeat_train")


def test_repeat_train_defaults():
    args = repeat_train.parse_args([])
    assert (args.jobs, args.np, args.model, args.batch_size, args.image_size) == (10, 4, "alexnet", 16, 224)
    assert (args.warmup_steps, args.steps, args.compute_steps) == (2, 5, 0)
    assert (args.backend, args.peer, args.peer_every) == ("fasthorovod", "horovod", 5)
    assert args.out == "results/repeat_train.json" and args.plot is None
    main, peer = repeat_train.backends(args)
    assert common.backend_env(main) == {}  # FastHorovod's defaults: nothing set
    assert peer.kind == "horovod-gloo"
    # the worker command is train.py's own, with these settings
    argv = train.worker_argv(main, args)
    assert argv[2].endswith("train.py") and argv[argv.index("--steps") + 1] == "5"
    assert argv[argv.index("--compute-steps") + 1] == "0"


def test_repeat_train_options():
    args = repeat_train.parse_args(
        ["--jobs", "3", "--peer-every", "0", "--backend", "fasthorovod:4x2", "--steps", "7",
         "--launcher-prefix", ".venv/bin/fasthorovodrun --emulate-cloud 4:1gbit:200mbit"])
    assert args.launcher_prefix == [".venv/bin/fasthorovodrun", "--emulate-cloud", "4:1gbit:200mbit"]
    assert (args.jobs, args.peer_every, args.steps) == (3, 0, 7)
    assert repeat_train.backends(args)[0].sockets == 2
    for bad in (["--jobs", "0"], ["--peer-every", "-1"], ["--backend", "mpi4py"],
                ["--peer", "fasthorovod:0"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            repeat_train.parse_args(bad)


@pytest.mark.parametrize("jobs, every, expected", [
    (10, 5, "MMMMMP" * 2), (2, 5, "MMP"), (7, 5, "MMMMMPMMP"), (3, 1, "MP" * 3), (4, 0, "MMMM")])
def test_repeat_train_order(jobs, every, expected):
    order = repeat_train.job_order(jobs, every)
    assert "".join(role[0].upper() for role in order) == expected


def _job(job, role, rate=None, status="ok"):
    entry = {"job": job, "role": role, "status": status, "backend": role}
    if status == "ok":
        entry["result"] = {"images_per_s": rate}
    else:
        entry["reason"] = "timed out after 600 s"
    return entry


def test_repeat_train_summary(capsys):
    entries = [_job(1, "main", 12.0), _job(2, "main", 6.0), _job(3, "main", 10.0),
               _job(4, "peer", 3.0), _job(5, "main", status="failed"), _job(6, "main", 11.0),
               _job(7, "peer", 5.0)]
    summary = repeat_train.summarize(entries)
    main = summary["main"]
    assert main["images_per_s"] == [12.0, 6.0, 10.0, 11.0] and main["n"] == 4
    assert (main["min"], main["median"], main["max"]) == (6.0, 10.5, 12.0)
    assert main["slowest_over_fastest"] == pytest.approx(0.5)
    assert summary["peer"]["median"] == 4.0
    assert summary["median_ratio_vs_peer"] == pytest.approx(10.5 / 4.0)
    assert [bad["job"] for bad in summary["not_ok"]] == [5]
    for entry in entries:
        if entry["status"] == "ok":
            entry["result"].update(step_s=1.0, data_plane=None)
    repeat_train.print_summary(entries, summary, repeat_train.parse_args([]))
    printed = capsys.readouterr().out
    assert "min 6.00  median 10.50  max 12.00  slowest/fastest 0.50" in printed
    assert "median fasthorovod / median horovod: 2.62x" in printed
    assert "job 5 (main): failed: timed out after 600 s" in printed
    no_peer = repeat_train.summarize([_job(1, "main", 2.0)])
    assert no_peer["peer"] is None and no_peer["median_ratio_vs_peer"] is None
    assert no_peer["main"]["slowest_over_fastest"] == 1.0


@pytest.mark.multiproc
@pytest.mark.slow
def test_repeat_train_driver_end_to_end(tmp_path):
    _require_horovod()
    report, plot, stdout = _run_driver(
        "repeat_train.py", ["--jobs", "2", "--backend", "horovod", "--peer-every", "0", "--np", "2",
                            "--model", "alexnet", "--image-size", "32", "--batch-size", "2",
                            "--num-classes", "10", "--steps", "2", "--warmup-steps", "0",
                            "--timeout", "100"], tmp_path)
    assert report["order"] == ["main", "main"]
    assert [(e["job"], e["role"], e["status"]) for e in report["backends"]] == [(1, "main", "ok"),
                                                                                (2, "main", "ok")]
    rates = [e["result"]["images_per_s"] for e in report["backends"]]
    assert all(rate > 0 for rate in rates)
    assert all(len(e["result"]["step_times_s"]) == 2 and e["result"]["compute_s"] is None
               for e in report["backends"])
    assert report["summary"]["main"]["images_per_s"] == rates and report["summary"]["peer"] is None
    assert report["args"]["backend"] == "horovod"
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "job 2/2 horovod" in stdout and "slowest/fastest" in stdout


# --------------------------------------------------------------------------------------------
# sweep.py

sweep = _load("sweep")


def test_sweep_defaults_and_grid_expansion():
    args = sweep.parse_args([])
    assert (args.np, args.size, args.rounds, args.out) == (None, 64 << 20, 3, "results/sweep.json")
    assert sweep.networks(args) == [("loopback", None, 4)]
    assert args.grid == [(k, s) for k in (1, 2, 4, 8) for s in (1, 2, 4)] and args.peers == []
    assert args.ring and args.clouds is None
    plan = sweep.round_plan(args.grid, args.peers, args.ring)
    assert plan[:3] == ["tcp-ring", "fasthorovod", "fasthorovod:1x1"] and plan[-1] == "fasthorovod:8x4"
    assert len(plan) == 2 + 12
    envs = {label: common.backend_env(common.parse_backend(label)) for label in plan[1:]}
    assert envs["fasthorovod"] == {}  # the defaults: no FASTHOROVOD_* variable
    assert envs["fasthorovod:8x2"] == {"FASTHOROVOD_NUM_LANES": "8", "FASTHOROVOD_SOCKETS_PER_LANE": "2"}
    # the allreduce jobs are allreduce.py's worker at the one size
    worker = allreduce.worker_argv(common.parse_backend("fasthorovod:2x2"), sweep.allreduce_settings(args))
    assert worker[2].endswith("allreduce.py")
    assert worker[worker.index("--sizes") + 1] == str(64 << 20) and worker[worker.index("--iters") + 1] == "5"


def test_sweep_options():
    args = sweep.parse_args(["--grid", "1x1,2x2", "--peers", "horovod", "--size", "4MiB", "--rounds", "1",
                             "--clouds", "4:1gbit:200mbit", "3:1gbit:100mbit", "--iters", "2"])
    assert args.grid == [(1, 1), (2, 2)] and args.peers == ["horovod"] and args.size == 4 << 20
    nets = sweep.networks(args)  # one rank per emulated host
    assert [(label, np_) for label, _, np_ in nets] == [("4:1gbit:200mbit", 4), ("3:1gbit:100mbit", 3)]
    assert nets[1][1] == ["fasthorovodrun", "--emulate-cloud", "3:1gbit:100mbit"]
    net_args = sweep.network_args(args, nets[1][1], 3)
    assert (net_args.np, net_args.launcher_prefix, net_args.threads) == (3, nets[1][1], common.default_threads(3))
    assert args.np is None and args.launcher_prefix is None  # the driver's own options stay as given
    args = sweep.parse_args(["--clouds", "5:800mbit:200mbit", "--launcher-prefix", ".venv/bin/fasthorovodrun -v",
                             "--np", "10"])
    assert sweep.networks(args) == [("5:800mbit:200mbit", [".venv/bin/fasthorovodrun", "-v", "--emulate-cloud",
                                                          "5:800mbit:200mbit"], 10)]
    args = sweep.parse_args(["--launcher-prefix", "fasthorovodrun --emulate-cloud 2:1gbit:200mbit"])
    assert sweep.networks(args)[0][0::2] == ("2:1gbit:200mbit", 2)
    assert sweep.cloud_hosts("5:1gbit:200mbit,host1=100mbit,host3=500mbit:150mbit") == 5
    assert sweep.cloud_hosts("loopback") is None and sweep.cloud_hosts("horovodrun -v") is None
    assert sweep.network_label(None) == "loopback"
    assert sweep.network_label(["fasthorovodrun", "--emulate-cloud=2:1gbit:200mbit"]) == "2:1gbit:200mbit"
    for bad in (["--grid", "2"], ["--grid", "0x1"], ["--grid", "2x"], ["--grid", "1x1,1x1"],
                ["--size", "6"], ["--rounds", "0"], ["--peers", "nccl"], ["--np", "0"],
                ["--clouds", "4:1gbit:200mbit", "--launcher-prefix", "fasthorovodrun --emulate-cloud 2:1gbit:1gbit"]):
        with pytest.raises(SystemExit):
            sweep.parse_args(bad)


def test_sweep_interleaves_rounds():
    plan = sweep.round_plan([(1, 1), (2, 2)], ["horovod"])
    assert plan == ["tcp-ring", "fasthorovod", "fasthorovod:1x1", "fasthorovod:2x2", "horovod"]
    assert sweep.round_plan([(4, 1)], [], ring=False) == ["fasthorovod", "fasthorovod:4x1"]
    order = sweep.run_order(plan, 2)
    assert order == [(1, label) for label in plan] + [(2, label) for label in plan]


def _allreduce_entry(label, seconds, status="ok", np_=4, nbytes=64 << 20):
    if status != "ok":
        return {"backend": label, "status": status, "reason": "exit status 1"}
    return {"backend": label, "status": "ok",
            "result": {"np": np_, "tcp_connections": [1], "results": [{
                "bytes": nbytes, "iters": 5, "median_s": seconds, "p90_s": seconds,
                "busbw_gbps": allreduce.bus_bandwidth_gbps(nbytes, seconds, np_), "verified": True}]}}


def test_sweep_summary_math(capsys):
    rounds = [[_allreduce_entry("fasthorovod", 1.0), _allreduce_entry("fasthorovod:1x1", 4.0),
               _allreduce_entry("fasthorovod:4x2", 0.9), _allreduce_entry("fasthorovod:8x4", 1.0, "failed")],
              [_allreduce_entry("fasthorovod", 2.0), _allreduce_entry("fasthorovod:1x1", 4.2),
               _allreduce_entry("fasthorovod:4x2", 1.0), _allreduce_entry("fasthorovod:8x4", 0.5)],
              [_allreduce_entry("fasthorovod", 1.2), _allreduce_entry("fasthorovod:1x1", 3.8),
               _allreduce_entry("fasthorovod:4x2", 1.1), _allreduce_entry("fasthorovod:8x4", 0.5)]]
    configs = allreduce.merge_rounds(rounds)
    # median of the rounds' medians: 1.2 s for the defaults, 1.0 s for 4x2
    assert configs[0]["result"]["results"][0]["median_s"] == pytest.approx(1.2)
    assert sweep.round_rates(configs[0], 4) == pytest.approx(
        [allreduce.bus_bandwidth_gbps(64 << 20, t, 4) for t in (1.0, 2.0, 1.2)])
    assert configs[3]["status"] == "failed"  # failed in one round: not ranked
    ceiling = sweep.merge_ring([
        {"backend": "tcp-ring", "status": "ok", "result": {"mean_gbps": 0.9, "min_gbps": 0.8, "flows": 15}},
        {"backend": "tcp-ring", "status": "failed", "reason": "exit status 1"},
        {"backend": "tcp-ring", "status": "ok", "result": {"mean_gbps": 0.7, "min_gbps": 0.6, "flows": 15}}])
    assert (ceiling["mean_gbps"], ceiling["min_gbps"], ceiling["rounds_measured"]) == (0.8, 0.7, 2) and ceiling["flows"] == 15
    summary = sweep.summarize(configs, ceiling, ["fasthorovod:1x1", "fasthorovod:4x2", "fasthorovod:8x4"])
    defaults = allreduce.bus_bandwidth_gbps(64 << 20, 1.2, 4)
    best = allreduce.bus_bandwidth_gbps(64 << 20, 1.0, 4)
    assert summary["best_grid"] == "fasthorovod:4x2"
    assert summary["defaults_gbps"] == pytest.approx(defaults)
    assert summary["defaults_over_best_grid"] == pytest.approx(1.0 / 1.2)
    assert summary["defaults_over_ceiling"] == pytest.approx(defaults / 0.8)
    assert summary["best_grid_over_ceiling"] == pytest.approx(best / 0.8)
    network = {"network": "4:1gbit:200mbit", "np": 4, "ceiling": ceiling, "configs": configs,
               "summary": summary}
    sweep.print_network(network, sweep.parse_args([]))
    printed = capsys.readouterr().out
    assert "0.800 Gbit/s per host (min 0.700)" in printed
    assert "defaults / best grid cell (fasthorovod:4x2" in printed and "0.83x" in printed
    assert f"defaults / ceiling: {defaults / 0.8:.2f}x" in printed
    assert "fasthorovod:8x4: failed" in printed
    # nothing to compare with: ratios are None, not errors
    none = sweep.summarize(configs[:1], sweep.merge_ring([]), [])
    assert none["best_grid"] is None and none["defaults_over_best_grid"] is None
    assert none["defaults_over_ceiling"] is None and none["ceiling_gbps"] is None


# --------------------------------------------------------------------------------------------
# make bench: rounds, spread, ceiling, exposed communication


def test_spread_and_paired_ratios():
    assert common.spread([3.0, 1.0, 2.0, None]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert common.spread([2.0, 4.0])["median"] == 3.0
    assert common.spread([]) is None and common.spread([None]) is None
    assert common.format_spread(common.spread([0.75, 0.8, 0.78])) == "0.78 [0.75-0.80]"
    assert common.format_spread(common.spread([1.5]), 3, "x") == "1.500x"
    assert common.format_spread(None) == "-"
    # round by round; a round without a denominator is left out
    assert common.paired_ratios([4.0, 6.0, 9.0], [2.0, None, 3.0]) == [2.0, 3.0]
    assert common.paired_ratios([1.0], [0.0]) == []
    assert common.clock(125) == "2:05"


def test_rounds_interleave_backends():
    assert common.interleave(["a", "b", "c"], 2) == [(1, "a"), (1, "b"), (1, "c"),
                                                     (2, "a"), (2, "b"), (2, "c")]
    assert common.interleave(["a"], 0) == []
    assert sweep.run_order(["x", "y"], 2) == common.interleave(["x", "y"], 2)


def test_fasthorovod_algorithm_without_count_runs_defaults():
    for spec in ("fasthorovod:ssd-sgd", "fasthorovod::ssd-sgd"):
        backend = common.parse_backend(spec, train.KINDS, with_algorithm=True)
        assert (backend.count, backend.sockets, backend.algorithm) == (None, None, "ssd-sgd")
        assert common.backend_env(backend) == {}
    with pytest.raises(ValueError):
        common.parse_backend("fasthorovod:ssd-sgd")  # allreduce.py: no algorithms
    with pytest.raises(ValueError):
        common.parse_backend("fasthorovod::", with_algorithm=True)


def test_settings_note_labels_hand_set_variants(monkeypatch):
    for key in [k for k in os.environ if k.startswith("FASTHOROVOD_")]:
        monkeypatch.delenv(key)
    note = common.settings_note(["horovod", "fasthorovod", "fasthorovod:4x2"])
    assert "fasthorovod: FastHorovod's defaults (no FASTHOROVOD_* set)" in note
    assert ("fasthorovod:4x2: hand-set FASTHOROVOD_NUM_LANES=4 FASTHOROVOD_SOCKETS_PER_LANE=2"
            in note)
    assert "hand-set FASTHOROVOD_PROXY_THRESHOLD_BYTES=65536" in common.settings_note(["fasthorovod"], 65536)
    assert common.settings_note(["horovod"]) is None
    monkeypatch.setenv("FASTHOROVOD_SOCKETS_PER_LANE", "2")
    assert "inheriting FASTHOROVOD_SOCKETS_PER_LANE=2" in common.settings_note(["fasthorovod"])


def test_a_backends_lane_settings_replace_those_inherited_under_their_former_names():
    from fasthorovod.config import ALIASES

    assert common.FORMER_NAMES == ALIASES
    inherited = {"FASTHOROVOD_NUM_PROXIES": "8", "FASTHOROVOD_SOCKETS_PER_PROXY": "3", "KEEP": "1"}
    env = common.job_env({}, common.backend_env(common.parse_backend("fasthorovod:4")), environ=inherited)
    assert env == {"FASTHOROVOD_NUM_LANES": "4", "FASTHOROVOD_SOCKETS_PER_PROXY": "3", "KEEP": "1"}
    assert common.job_env(common.backend_env(common.parse_backend("fasthorovod")), environ=inherited) == inherited


def _rounds_of(label_seconds):
    """Rounds of allreduce entries from {label: [seconds per round]} (64 MiB, 4 ranks)."""
    labels = list(label_seconds)
    count = len(label_seconds[labels[0]])
    return [[_allreduce_entry(label, label_seconds[label][i]) for label in labels] for i in range(count)]


def test_allreduce_merge_reports_spread_ceiling_fraction_and_plot_line(capsys):
    merged = allreduce.merge_rounds(_rounds_of({"horovod": [4.0, 4.4, 4.2], "fasthorovod": [1.0, 1.5, 1.1]}))
    fast = merged[1]["result"]["results"][0]
    bw = lambda t: allreduce.bus_bandwidth_gbps(64 << 20, t, 4)  # noqa: E731
    assert (fast["median_s"], fast["min_s"], fast["max_s"]) == (1.1, 1.0, 1.5)
    assert fast["busbw_gbps"] == pytest.approx(bw(1.1))
    assert (fast["busbw_min_gbps"], fast["busbw_max_gbps"]) == (pytest.approx(bw(1.5)), pytest.approx(bw(1.0)))
    assert fast["round_busbw_gbps"] == pytest.approx([bw(1.0), bw(1.5), bw(1.1)])
    ring = [{"backend": "tcp-ring", "status": "ok", "result": {"mean_gbps": g, "min_gbps": g, "flows": 15}}
            for g in (0.9, 0.8, 1.0)]
    ceiling = common.merge_ring(ring)
    assert ceiling["spread"] == {"median": 0.9, "min": 0.8, "max": 1.0, "n": 3}
    summary = allreduce.summarize(merged, ceiling, common.round_ceilings(ring))
    cell = summary[64 << 20]["fasthorovod"]
    assert cell["of_ceiling"] == pytest.approx(bw(1.1) / 0.9)
    assert cell["of_ceiling_rounds"]["min"] == pytest.approx(min(bw(1.0) / 0.9, bw(1.5) / 0.8, bw(1.1) / 1.0))
    assert cell["vs_first"] == pytest.approx(4.2 / 1.1)
    assert cell["vs_first_rounds"]["max"] == pytest.approx(4.0 / 1.0)  # round 1: 4.0 s / 1.0 s
    assert summary[64 << 20]["horovod"]["vs_first_rounds"]["min"] == pytest.approx(1.0)
    data = allreduce.plot_data(merged, ceiling)
    assert data["ceiling_gbps"] == 0.9
    series = data["series"][1]
    assert series["label"] == "fasthorovod" and series["busbw"] == [pytest.approx(bw(1.1))]
    low, high = series["busbw_err"]
    assert low == [pytest.approx(bw(1.1) - bw(1.5))] and high == [pytest.approx(bw(1.0) - bw(1.1))]
    assert min(low + high) >= 0
    assert allreduce.plot_data(merged, {"status": "skipped", "reason": "loopback"})["ceiling_gbps"] is None
    allreduce.print_table(merged, [64 << 20], ceiling, summary)
    printed = capsys.readouterr().out
    assert "0.900 [0.800-1.000] Gbit/s per host" in printed
    assert f"{bw(1.1) / 0.9:.2f}x [" in printed and "3.82x [" in printed
    # a backend that failed in one round is not merged, and is listed
    failed = allreduce.merge_rounds([[_allreduce_entry("fasthorovod", 1.0)],
                                     [_allreduce_entry("fasthorovod", 1.0, "failed")]])
    assert failed[0]["status"] == "failed" and len(failed[0]["rounds"]) == 2


def test_allreduce_ceiling_option_and_bench_command_lines():
    args = allreduce.parse_args(["--ceiling", "--proxy-threshold", "default", "--rounds", "3"])
    assert args.ceiling and args.proxy_threshold is None and (args.ring_flows, args.ring_seconds) == (None, 3.0)
    assert allreduce.parse_args([]).proxy_threshold == 64 << 10 and not allreduce.parse_args([]).ceiling
    argv = common.ring_worker_argv(allreduce.__file__, args)
    assert argv[2].endswith("allreduce.py") and argv[argv.index("--backend") + 1] == common.RING
    assert "--ring-pattern" not in argv  # an allreduce's ceiling: the ring
    alltoall = allreduce.parse_args(["--ceiling", "--collective", "alltoall"])
    argv = common.ring_worker_argv(allreduce.__file__, alltoall)
    assert argv[argv.index("--ring-pattern") + 1] == "mesh"  # an alltoall's: every host to every other
    assert allreduce.parse_args(argv[3:] + ["--result-file", "x"]).ring_pattern == "mesh"
    mesh = common.merge_ring([{"status": "ok", "result": {"mean_gbps": 0.9, "min_gbps": 0.8, "flows": 5,
                                                          "pattern": "mesh"}}])
    assert "mesh ceiling" in common.ceiling_line(mesh) and "every host to every other" in common.ceiling_line(mesh)
    assert "to every other host" in common.ring_line(mesh["rounds"][0])
    with pytest.raises(SystemExit):
        allreduce.parse_args(["--ring-flows", "0"])
    # what scripts/bench.sh runs parses, with FastHorovod's defaults
    bench = (BENCHMARKS.parent / "scripts" / "bench.sh").read_text()
    assert "FASTHOROVOD_SOCKETS_PER_LANE=" not in bench and "FASTHOROVOD_SOCKETS_PER_PROXY=" not in bench
    assert "--ceiling" in bench
    train_args = train.parse_args(["--np", "4", "--steps", "4", "--warmup-steps", "1", "--compute-steps", "2",
                                   "--rounds", "3", "--backends", "horovod,fasthorovod,fasthorovod:ssd-sgd"])
    assert [common.backend_env(b) for b in common.parse_backends(train_args.backends, train.KINDS, True)] == [{}] * 3
    with pytest.raises(SystemExit):
        train.parse_args(["--steps", "2", "--compute-steps", "3"])
    with pytest.raises(SystemExit):
        train.parse_args(["--rounds", "0"])


def test_train_step_schedule_pairs_compute_with_training_steps():
    schedule = train.step_schedule(1, 4, 2)
    assert [(kind[0], timed) for kind, timed, _ in schedule] == [
        ("c", False), ("t", False), ("c", True), ("t", True), ("t", True), ("t", True), ("c", True), ("t", True)]
    # timed training steps 0 and 2 have partners; compute first in pair 0, second in pair 1 (ABBA)
    assert [(kind, pair) for kind, timed, pair in schedule if pair is not None] == [
        ("compute", 0), ("train", 0), ("train", 1), ("compute", 1)]
    assert sum(1 for kind, timed, _ in train.step_schedule(2, 3, 3) if kind == "compute" and timed) == 3
    assert all(kind == "train" for kind, _, _ in train.step_schedule(2, 5, 0))
    calls = []
    steps, compute, paired, phases, loaded = train.run_schedule(
        schedule, lambda: calls.append("t"), lambda: calls.append("c") or {"forward": len(calls)}, verbose=False)
    assert "".join(calls) == "ctctttct"  # the schedule's order
    assert (len(steps), len(compute), paired, loaded) == (4, 2, [0, 2], [])
    assert phases == [{"forward": 3}, {"forward": 7}]  # what the timed compute-only steps returned
    # --loaded-compute: a loaded step after every compute-only step, timed where it is
    schedule = train.step_schedule(1, 4, 2, loaded=True)
    assert [(kind[0], timed) for kind, timed, _ in schedule] == [
        ("c", False), ("l", False), ("t", False), ("c", True), ("l", True), ("t", True), ("t", True), ("t", True),
        ("c", True), ("l", True), ("t", True)]
    calls = []
    *_, phases, loaded = train.run_schedule(
        schedule, lambda: calls.append("t"), lambda: calls.append("c") or {"forward": len(calls)}, verbose=False,
        loaded_step=lambda: calls.append("l") or {"backward": len(calls)})
    assert "".join(calls) == "cltcltttclt"
    assert phases == [{"forward": 4}, {"forward": 9}] and loaded == [{"backward": 5}, {"backward": 10}]
    # the job's barrier follows every compute-only and loaded step, outside the timed span
    calls = []
    _, compute, *_ = train.run_schedule(
        schedule, lambda: calls.append("t"), lambda: calls.append("c"), verbose=False,
        loaded_step=lambda: calls.append("l"), barrier=lambda: calls.append("|") or time.sleep(0.05))
    assert "".join(calls) == "c|l|tc|l|tttc|l|t"
    assert len(compute) == 2 and max(compute) < 0.05


def test_the_language_model_takes_its_own_defaults_and_at_most_its_positions():
    args = train.parse_args(["--model", "transformer"])
    assert (args.batch_size, args.num_classes, args.seq_len) == (4, 32000, 128)
    assert (train.parse_args([]).batch_size, train.parse_args([]).num_classes) == (16, 1000)
    assert train.parse_args(["--model", "transformer", "--seq-len", "512"]).seq_len == 512
    for bad in (["--seq-len", "513"], ["--seq-len", "0"]):
        with pytest.raises(SystemExit):
            train.parse_args(["--model", "transformer", *bad])


def test_overlap_bound_hides_the_ring_behind_backward_only():
    ceiling = {"mean_gbps": 0.8, "hosts": ["h0", "h1", "h2", "h3"]}
    result = {"gradient_bytes": 100e6, "step_s": 3.0,
              "compute_phases_s": {"forward": 0.5, "backward": 1.0, "update": 0.2}}
    bound = train.overlap_bound(result, ceiling)
    # each host moves 2 * 3/4 of 100 MB at 100 MB/s: 1.5 s, longer than backward
    assert bound["ring_s"] == pytest.approx(1.5)
    assert bound["bound_s"] == pytest.approx(0.5 + 1.5 + 0.2)
    assert bound["of_bound"] == pytest.approx(3.0 / 2.2)
    # fp16 on the wire halves the ring: backward (1.0 s) is then the longer
    assert train.overlap_bound(result, ceiling, 0.5)["bound_s"] == pytest.approx(0.5 + 1.0 + 0.2)
    assert "loaded_bound_s" not in bound
    # with loaded compute-only steps (--loaded-compute), their backward makes a second bound
    loaded = train.overlap_bound(dict(result, loaded_phases_s={"forward": 0.6, "backward": 1.8, "update": 0.3}),
                                 ceiling)
    assert loaded["bound_s"] == pytest.approx(2.2)  # unchanged
    assert loaded["loaded_bound_s"] == pytest.approx(0.5 + 1.8 + 0.2) and loaded["of_loaded_bound"] == pytest.approx(1.2)
    assert "first_gradient_bound_s" not in bound  # phases without the first gradient's moment
    assert train.overlap_bound(result, None) is None
    assert train.overlap_bound(dict(result, compute_phases_s=None), ceiling) is None
    assert train.overlap_bound(result, dict(ceiling, hosts=["h0"])) is None


def test_first_gradient_bound_starts_the_ring_with_the_first_gradient():
    ceiling = {"mean_gbps": 0.8, "hosts": ["h0", "h1", "h2", "h3"]}  # ring of 100 MB: 1.5 s
    phases = {"forward": 0.5, "backward": 1.0, "update": 0.2}
    # the first gradient 0.1 s into backward: the ring ends at 0.6 + 1.5, after backward
    early = train.overlap_bound({"gradient_bytes": 100e6, "step_s": 2.53,
                                 "compute_phases_s": dict(phases, first_gradient=0.6)}, ceiling)
    assert early["bound_s"] == pytest.approx(2.2)
    assert early["first_gradient_bound_s"] == pytest.approx(0.6 + 1.5 + 0.2)
    assert early["of_first_gradient_bound"] == pytest.approx(1.1)
    # a cheap ring hides behind backward wherever it starts: both bounds are forward + backward + update
    cheap = train.overlap_bound({"gradient_bytes": 10e6, "step_s": 2.0,
                                 "compute_phases_s": dict(phases, first_gradient=1.2)}, ceiling)
    assert cheap["first_gradient_bound_s"] == pytest.approx(cheap["bound_s"]) == pytest.approx(1.7)


def test_compute_step_times_the_first_gradient_within_backward():
    args = train.parse_args(["--model", "transformer", "--seq-len", "8", "--batch-size", "2", "--num-classes", "50"])
    model, _, compute_step = train.synthetic_problem(args, rank=0)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        phases = compute_step()
        assert set(phases) == set(train.PHASES)
        assert phases["forward"] < phases["first_gradient"] < phases["forward"] + phases["backward"]
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # weights untouched
    assert all(not p._backward_hooks for p in model.parameters())  # the timing hooks are gone


def test_exposed_comm_is_never_negative_and_flags_noise():
    clear = train.exposed_comm([1.6, 1.4, 1.9, 1.7, 1.5, 1.8])
    assert clear["measurable"] and clear["exposed_comm_s"] == pytest.approx(1.65) and clear["reason"] is None
    assert 0 < clear["q1_s"] <= clear["exposed_comm_s"] <= clear["q3_s"]
    # SSD-SGD-like: the step is as fast as computing alone; some pairs come out negative
    noisy = train.exposed_comm([0.2, -0.3, 0.1, -0.1, 0.05, -4.2])
    assert not noisy["measurable"] and noisy["exposed_comm_s"] is None
    assert noisy["q1_s"] is None and noisy["q3_s"] is None
    assert noisy["reason"] == "not measurable (within noise)" and noisy["bound_s"] >= 0
    assert train.exposed_comm([-1.0, -2.0])["bound_s"] == 0.0
    assert train.exposed_comm([]) == {"pairs": 0, "measurable": False, "exposed_comm_s": None, "q1_s": None,
                                      "q3_s": None, "bound_s": None,
                                      "reason": "not measured (no compute-only steps)"}
    for values in ([0.1] * 3 + [-1] * 3, [0.01, 0.02, -0.5, 0.03], [-0.1], [0.3], [-1.19] * 9, []):
        result = train.exposed_comm(values)
        assert result["exposed_comm_s"] is None or result["exposed_comm_s"] > 0
        assert (result["exposed_comm_s"] is None) == (result["reason"] is not None)
        _assert_no_negative_exposed_time(result)
    assert train.exposed_cell(noisy) == "not measurable (within noise)"
    assert train.exposed_cell(clear) == "1.650 [1.525-1.775]"
    assert train.exposed_cell(train.exposed_comm([])) == "-" and train.exposed_cell(None) == "-"


def _assert_no_negative_exposed_time(value, where="result"):
    """No exposed-communication figure anywhere in `value` (a train.json or part of it) is negative,
    and one that is absent says why."""
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{where}.{key}"
            if key == "exposed_comm" and item is not None:
                numbers = {k: v for k, v in item.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                assert all(v >= 0 for v in numbers.values()), (here, item)
                assert item["exposed_comm_s"] is not None or item["reason"], (here, item)
            if key == "exposed_comm_s":
                assert item is None or item > 0, (here, item)
            _assert_no_negative_exposed_time(item, here)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _assert_no_negative_exposed_time(item, f"{where}[{index}]")


def _train_job(steps, compute, paired=None, rate_scale=1.0):
    paired = list(range(len(compute))) if paired is None else paired
    step_s = float(sorted(steps)[len(steps) // 2])
    return {"backend": "x", "status": "ok", "seconds": 10.0, "result": {
        "np": 4, "threads": 1, "algorithm": "ssgd", "gradient_bytes": 1, "data_plane": None,
        "images_per_s": 64 / step_s * rate_scale, "step_s": step_s,
        "compute_s": float(sorted(compute)[len(compute) // 2]) if compute else None,
        "step_times_s": steps, "compute_times_s": compute, "paired_steps": paired}}


def test_train_merge_rounds_and_breakdown(capsys):
    horovod = [_train_job([17.0, 17.5, 17.2], [3.1, 3.0, 3.2]), _train_job([18.0, 17.8, 18.2], [3.3, 3.1, 3.2]),
               _train_job([16.9, 17.0, 17.1], [3.0, 3.0, 3.1])]
    ssd = [_train_job([3.0, 2.9, 3.1], [3.2, 2.8, 3.3]), _train_job([3.1, 3.0, 3.0], [3.6, 3.1, 3.3]),
           _train_job([2.8, 3.0, 2.9], [3.2, 3.1, 2.7])]
    rounds = [[dict(h, backend="horovod"), dict(s, backend="fasthorovod:ssd-sgd")] for h, s in zip(horovod, ssd)]
    merged = train.merge_rounds(rounds)
    h, s = merged[0]["result"], merged[1]["result"]
    assert h["rounds"] == 3 and h["step_s"] == 17.2 and h["spread"]["step_s"] == {
        "median": 17.2, "min": 17.0, "max": 18.0, "n": 3}
    assert h["images_per_s"] == pytest.approx(64 / 17.2) and h["round_images_per_s"][1] == pytest.approx(64 / 18.0)
    assert h["exposed_comm"]["measurable"] and h["exposed_comm"]["pairs"] == 9 and h["exposed_comm_s"] > 13
    assert not s["exposed_comm"]["measurable"] and s["exposed_comm_s"] is None
    # SSD-SGD's compute-only steps took longer than its training steps: the stored JSON holds no
    # negative exposed time (it used to keep the median step - compute, -0.2 s here) but the reason
    saved = json.loads(json.dumps({"backends": merged}))
    _assert_no_negative_exposed_time(saved)
    assert saved["backends"][1]["result"]["exposed_comm"]["reason"] == "not measurable (within noise)"
    assert s["compute_s"] > s["step_s"]  # compute-only slower than the step: noise or shared CPUs
    for result in (h, s):
        parts = train.breakdown(result)
        assert sum(parts.values()) == pytest.approx(result["step_s"])
        assert parts["compute"] <= result["step_s"] and min(parts.values()) >= 0
    assert train.breakdown(s) == {"compute": s["step_s"], "exposed": 0.0, "unsplit": 0.0}
    assert train.breakdown({"step_s": 5.0, "compute_s": None}) == {"compute": 0.0, "exposed": 0.0, "unsplit": 5.0}
    within = {"step_s": 5.0, "compute_s": 4.5, "exposed_comm": train.exposed_comm([0.5, -0.4, 0.6, -0.2])}
    assert train.breakdown(within) == {"compute": 4.5, "exposed": 0.0, "unsplit": pytest.approx(0.5)}
    ratios = train.speedups(merged)
    assert ratios["fasthorovod:ssd-sgd"]["ratio"] == pytest.approx(s["images_per_s"] / h["images_per_s"])
    assert ratios["fasthorovod:ssd-sgd"]["rounds"]["n"] == 3
    assert train.error_bars([2.0, 5.0], [{"min": 1.5, "max": 2.5}, None]) == [[0.5, 0.0], [0.5, 0.0]]
    args = train.parse_args(["--np", "4", "--steps", "3", "--compute-steps", "3", "--rounds", "3"])
    train.print_table(merged, args)
    printed = capsys.readouterr().out
    assert "not measurable (within noise)" in printed and "17.200 [17.000-18.000]" in printed
    ssd_cells = next(line for line in printed.splitlines() if line.startswith("fasthorovod:ssd-sgd"))
    assert s["exposed_comm"]["reason"] in ssd_cells  # the table says what the JSON says
    assert "compute-only steps took longer than training steps for fasthorovod:ssd-sgd" in printed
    assert train.compute_cell(s).startswith("contended (") and train.compute_cell(h) == "3.100 [3.000-3.200]"
    assert train.compute_cell({"step_s": 5.0, "compute_s": None}) == "-"
    ssd_row = next(line for line in printed.splitlines() if line.startswith("fasthorovod:ssd-sgd"))
    assert "contended (" in ssd_row  # never a bare compute time longer than the step beside it
    assert not re.search(r"(^|[\s\[(])-\d", printed, re.M)  # no negative number printed
    failed = train.merge_rounds([[dict(horovod[0], backend="horovod")],
                                 [{"backend": "horovod", "status": "failed", "reason": "timed out"}]])
    assert failed[0]["status"] == "failed" and len(failed[0]["rounds"]) == 2


def test_train_job_timeline():
    marks = ["process_created", "script_started", "imports_done", "hvd_imported", "hvd_init_done", "model_ready",
             "parameters_broadcast", "optimizer_state_broadcast", "steps_done"]
    clock = {mark: 1000.0 + 2 * i for i, mark in enumerate(marks)}
    entry = {"started_at": 999.0, "ended_at": 1020.0,
             "result": {"clock": clock, "data_plane": {"probe": {"seconds": 1.25}}}}
    phases = train.job_timeline(entry)
    assert phases["launch"] == 1.0 and phases["broadcast_optimizer_state"] == 2.0 and phases["steps"] == 2.0
    assert phases["startup"] == 15.0 and phases["finish"] == 4.0 and phases["path_probe"] == 1.25
    line = train.timeline_line(phases)
    assert line.startswith("start-up 15.0 s (launch 1.0, interpreter 2.0,") and "path probe 1.2" in line
    assert train.job_timeline({"started_at": 1.0, "result": {}}) is None  # an older worker: no clock
    assert train.job_timeline(dict(entry, result={"clock": dict(clock, model_ready=None)})) is None
    assert train.process_created() <= time.time()


def test_a_terminated_driver_leaves_no_job_running(tmp_path):
    """`timeout` SIGTERMs a driver: its job (here a sleeping process tree) must go with it."""
    marker = tmp_path / "job.pid"
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        "import _common as common\n"
        "job = common.Process(['sh', '-c', 'echo $$ > " + str(marker) + "; exec sleep 120'], {})\n"
        "common.run_job([job], timeout=100, extra_env={})\n")
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (marker.exists() and marker.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        job_pid = int(marker.read_text())
        proc.terminate()
        assert proc.wait(timeout=20) != 0
        gone = time.monotonic() + 10
        while psutil.pid_exists(job_pid) and psutil.Process(job_pid).status() != psutil.STATUS_ZOMBIE \
                and time.monotonic() < gone:
            time.sleep(0.1)
        assert not psutil.pid_exists(job_pid) or psutil.Process(job_pid).status() == psutil.STATUS_ZOMBIE
    finally:
        proc.kill()


def test_peer_steps_apply_to_every_backend_but_fasthorovod():
    args = train.parse_args(["--backends", "horovod,fasthorovod,fasthorovod:ssd-sgd", "--steps", "4",
                             "--peer-steps", "2", "--compute-steps", "3"])
    backends = common.parse_backends(args.backends, train.KINDS, with_algorithm=True)

    def steps(argv):
        return int(argv[argv.index("--steps") + 1]), int(argv[argv.index("--compute-steps") + 1])

    assert [steps(train.worker_argv(b, args)) for b in backends] == [(2, 2), (4, 3), (4, 3)]
    plain = train.parse_args(["--backends", "horovod", "--steps", "4", "--compute-steps", "3"])
    assert steps(train.worker_argv(common.parse_backends("horovod", train.KINDS, with_algorithm=True)[0],
                                   plain)) == (4, 3)
    with pytest.raises(SystemExit):
        train.parse_args(["--peer-steps", "0"])


@pytest.mark.multiproc
def test_placement_harness_measures_bytes_on_its_tcp_ring(tmp_path):
    """The placement model is of proxies on a TCP ring; its harness's two ranks share one host,
    where the default (hierarchical) allreduce would move nothing over TCP and leave every lane's
    rate at zero (the harness then divided by it)."""
    out = tmp_path / "placement.json"
    only = "k1 separated|k1 clustered|k2 two per CPU|k2 a lane per CPU"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "placement.py"), "--only", only, "--seconds", "0.1",
                           "--windows", "1", "--passes", "1", "--mib", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=BENCHMARKS.parent,
                          env=dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [p["name"] for p in report["placements"]] == only.split("|")
    for placement in report["placements"]:
        assert placement["measured"] > 0, placement["name"]
        for window in placement["windows"]:
            assert all(rate > 0 for rate in window["lane_rates"]), (placement["name"], window["lane_rates"])


def test_recorded_commands_name_no_path_of_this_machine(tmp_path):
    """Results files are kept in docs/results: their command lines say where a file is relative to
    the repository, and scratch files as $TMPDIR, never this machine's absolute paths."""
    repo = BENCHMARKS.parent
    line = common.portable_command(["/usr/bin/env", str(repo / ".venv" / "bin" / "python"),
                                    str(BENCHMARKS / "train.py"), "--result-file", str(tmp_path / "1.json")])
    assert str(repo) not in line and str(tmp_path.parent) not in line, line
    assert line.startswith("/usr/bin/env .venv/bin/python benchmarks/train.py --result-file '$TMPDIR/"), line
    store = common.portable_command(["--rendezvous", f"file://{tempfile.gettempdir()}/torch-gloo-store-1"])
    assert store == "--rendezvous 'file://$TMPDIR/torch-gloo-store-1'", store


# --- horovod_synthetic.py: Horovod's unmodified example under Horovod and under the patch switch ---

synthetic = _load("horovod_synthetic")

# A program in the example's shape: it imports horovod.torch itself, runs collectives and prints the
# example's lines, so that the driver's launch, switch check and parsing run for real without
# torchvision (the example itself needs .venv-torchvision, which the suite does not build).
STAND_IN = '''
import argparse, sys, time
import torch
import horovod.torch as hvd
p = argparse.ArgumentParser()
for flag in ("--model", "--batch-size", "--num-warmup-batches", "--num-batches-per-iter", "--num-iters"):
    p.add_argument(flag)
p.add_argument("--no-cuda", action="store_true")
args = p.parse_args()
hvd.init()
total = hvd.allreduce(torch.ones(1 << 18), op=hvd.Sum, name="g")
assert total[0].item() == hvd.size(), total[0]
if hvd.rank() == 0:
    print("Iter #0: 10.0 img/sec per CPU")
    print("Iter #1: 12.0 img/sec per CPU")
    print("Img/sec per CPU: 11.0 +-2.0")
    print("Total img/sec on %d CPU(s): %.1f +-4.0" % (hvd.size(), 11.0 * hvd.size()))
'''


def _stand_in_src(tmp_path):
    script = tmp_path / "hvd" / synthetic.SCRIPT
    script.parent.mkdir(parents=True)
    script.write_text(STAND_IN)
    return tmp_path / "hvd"


def test_synthetic_parses_the_examples_lines():
    lines = ["[1,0]<stdout>:Iter #0: 3.5 img/sec per CPU", "[1,0]<stdout>:Iter #1: 4.5 img/sec per CPU",
             "[1,0]<stderr>:[fasthorovod] horovod.torch is fasthorovod.torch in this job (the patch switch: ...)",
             "[1,0]<stdout>:Total img/sec on 4 CPU(s): 16.0 +-1.2"]
    assert synthetic.parse_output(lines, 4) == {"total_img_s": 16.0, "total_conf": 1.2, "iters": [3.5, 4.5],
                                                "patched": True}
    assert synthetic.parse_output(lines[:2] + lines[3:], 4)["patched"] is False
    with pytest.raises(ValueError, match="on 4 ranks, not 2"):
        synthetic.parse_output(lines, 2)
    with pytest.raises(ValueError, match="no 'Total img/sec' line"):
        synthetic.parse_output(lines[:3], 4)


def test_synthetic_launches_the_switch_only_for_fasthorovod(tmp_path):
    args = synthetic.parse_args(["--horovod-src", str(_stand_in_src(tmp_path)), "--python", sys.executable,
                                 "--np", "4", "--launcher-prefix", "fasthorovodrun --emulate-cloud 4:1gbit:200mbit"])
    horovod, fast = (synthetic.launch_argv(b, args) for b in synthetic.BACKENDS)
    assert horovod[:3] == ["fasthorovodrun", "--emulate-cloud", "4:1gbit:200mbit"] and "--patch-horovod" not in horovod
    assert fast[:4] == horovod[:3] + ["--patch-horovod"] and fast[4:] == horovod[3:]
    assert horovod[3:6] == ["--gloo", "-np", "4"] and horovod[-1] == "--no-cuda"
    args = synthetic.parse_args(["--horovod-src", str(tmp_path / "hvd"), "--python", sys.executable])
    assert Path(synthetic.launch_argv("horovod", args)[0]).name == "horovodrun"
    assert Path(synthetic.launch_argv("fasthorovod", args)[0]).name == "fasthorovodrun"


def test_synthetic_refuses_a_source_without_the_example(tmp_path, capsys):
    with pytest.raises(SystemExit):
        synthetic.parse_args(["--horovod-src", str(tmp_path), "--python", sys.executable])
    assert "examples/pytorch/pytorch_synthetic_benchmark.py" in capsys.readouterr().err


@pytest.mark.multiproc
def test_synthetic_driver_end_to_end(tmp_path):
    """Both backends for real at 2 ranks: the switch on only in the FastHorovod job, the figures
    read from the program's output, the ratio of the two."""
    _require_horovod()
    out = tmp_path / "synthetic.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "horovod_synthetic.py"), "--horovod-src",
                           str(_stand_in_src(tmp_path)), "--python", sys.executable, "--np", "2", "--rounds", "1",
                           "--timeout", "120", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    horovod, fast = report["backends"]
    assert horovod["status"] == fast["status"] == "ok", report["backends"]
    assert not horovod["result"]["patched"] and fast["result"]["patched"]
    assert fast["result"]["total_img_s"] == 22.0 and fast["result"]["iters"] == [10.0, 12.0]
    assert report["summary"]["speedup_rounds"] == [1.0]
    assert "--patch-horovod" in fast["commands"][0] and "--patch-horovod" not in horovod["commands"][0]
    assert "FastHorovod / Horovod, round by round: 1.00x" in proc.stdout

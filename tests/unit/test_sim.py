"""The performance model (fasthorovod.sim, docs/scale.md): each piece against a closed form, the
training policies against hand-computed schedules, the fit on synthetic measurements, and the CLI
end to end on a tiny calibration (no jobs: observations reused from a file)."""
import dataclasses
import json
import math
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from fasthorovod.sim import cli
from fasthorovod.sim import fit as fitting
from fasthorovod.sim import model as m
from fasthorovod.sim import training as tr

MiB = 1 << 20


def ideal(**kw):
    """No latency, no fixed costs, TCP at the configured rates, free copies."""
    base = dict(alpha_fh=0.0, t0_fh=0.0, alpha_hvd=0.0, t0_hvd=0.0, goodput=1.0, hvd_eff=1.0,
                copy_cost=0.0, kappa_net=0.0)
    base.update(kw)
    return m.Params(**base)


def cluster(**kw):
    base = dict(hosts=2, nic_bps=8e9, flow_bps=8e8, rtt_s=0.0, cores=1000.0)
    base.update(kw)
    return m.Cluster(**base)


# -- closed forms ------------------------------------------------------------------------------


def test_one_flow_one_hop_is_bytes_over_rate():
    # n = 2: each rank sends M/2 in the reduce-scatter and M/2 in the allgather: M over the flow
    assert m.ring_bytes(100.0, 2) == 100.0
    assert m.ring_time(100.0, 2, rate=10.0, alpha=0.0) == pytest.approx(10.0)
    assert m.ring_time(100.0, 2, rate=10.0, alpha=0.5) == pytest.approx(11.0)  # 2(n-1) = 2 steps
    assert m.busbw(100.0, 10.0, 2) == pytest.approx(10.0)
    assert m.ring_time(100.0, 1, 10.0, 1.0) == 0.0


def test_ring_of_n_ranks():
    n, M, r, a = 8, 64 * MiB, 1e9, 1e-4
    assert m.ring_time(M, n, r, a) == pytest.approx(2 * 7 * a + 2 * 7 / 8 * M / r)
    assert m.busbw(M, 2 * 7 / 8 * M / r, n) == pytest.approx(r)


def test_horovod_two_ranks_is_one_capped_flow():
    c = cluster()
    p = ideal(kappa_gloo=1e-15)
    out = m.horovod_allreduce(64 * MiB, c, p)
    assert out["seconds"] == pytest.approx(64 * MiB / c.flow_Bps)
    assert out["busbw"] == pytest.approx(c.flow_Bps)
    assert out["bound"] == "network"


def test_horovod_cpu_bound_by_gloo_thread():
    c = cluster(flow_bps=1e12, nic_bps=1e12)
    out = m.horovod_allreduce(MiB, c, ideal(kappa_gloo=1e-9))
    assert out["bound"] == "cpu" and out["rate"] == pytest.approx(1e9)


def test_per_flow_capped_versus_link_capped():
    p = ideal()
    c = cluster(nic_bps=8e9, flow_bps=8e8)  # 1 GB/s link, 0.1 GB/s per flow
    assert m.network_rate(c, k=2, S=2, p=p) == pytest.approx(4 * 1e8)     # 4 flows: per-flow capped
    assert m.network_rate(c, k=4, S=4, p=p) == pytest.approx(1e9)         # 16 flows: link capped
    assert m.network_rate(c, k=1, S=1, p=dataclasses.replace(p, goodput=0.95)) == pytest.approx(0.95e8)


def test_flow_buckets():
    assert m.distinct_buckets(5, None) == 5
    assert m.distinct_buckets(1, 16) == pytest.approx(1.0)
    assert m.distinct_buckets(2, 16) == pytest.approx(2 - 1 / 16)
    assert m.distinct_buckets(1000, 16) == pytest.approx(16, rel=1e-3)


def test_fasthorovod_network_bound_two_ranks():
    c = cluster()
    out = m.fasthorovod_allreduce(64 * MiB, c, m.Plane(k=4, S=2, threshold=0), ideal(kappa=1e-15))
    assert out["path"] == "proxies" and out["bound"] == "network"
    assert out["seconds"] == pytest.approx(64 * MiB / (8 * c.flow_Bps))  # 8 flows x 0.1 GB/s
    out = m.fasthorovod_allreduce(64 * MiB, c, m.Plane(k=4, S=3, threshold=0), ideal(kappa=1e-15))
    assert out["seconds"] == pytest.approx(64 * MiB / c.nic_Bps)  # 12 flows: the 1 GB/s link


def test_below_threshold_goes_through_horovod():
    out = m.fasthorovod_allreduce(1000, cluster(), m.Plane(threshold=4096), ideal())
    assert out["path"] == "horovod"


def test_cpu_bound_regime_shares_the_cores():
    # 1 core per host, 4 proxies: CPU-bound; r = cores / (threads * kappa_m), kappa_m with m = 4
    p = ideal(kappa=1e-9, eta=1.0, gamma=0.1)
    c = cluster(cores=1.0, nic_bps=1e12, flow_bps=1e12)
    plane = m.Plane(k=4, S=1, threshold=0)
    kap = 1e-9 * (1 + 0.1 * 3)
    rate = m.fasthorovod_rate(c, plane, p)
    assert rate["bound"] == "cpu"
    assert rate["cpu"] == pytest.approx(4 * 1.0 / (4 * kap))
    # alone on idle cores a proxy runs at eta / kappa
    big = cluster(cores=100.0, nic_bps=1e12, flow_bps=1e12)
    assert m.proxy_cpu_rate(big, m.Plane(k=1), ideal(kappa=1e-9, eta=0.9)) == pytest.approx(0.9e9)


def test_shared_machine_and_network_stack_cost():
    # the emulated cloud: H hosts on the same cores; every NIC byte costs kappa_net more
    p = ideal(kappa=1e-9, eta=1.0, gamma=0.0, kappa_net=3e-9)
    c = cluster(hosts=4, cores=2.0, shared_cores=2.0, nic_bps=1e12, flow_bps=1e12)
    r = m.proxy_cpu_rate(c, m.Plane(k=2), p)
    # per host 2 lanes at pace x: 4 hosts * 2 * x * (1e-9 + 3e-9) = 2 cores
    x = 2.0 / (8 * 1e-9 + 8 * 3e-9)
    assert r == pytest.approx(2 * x)


def test_hierarchical_does_the_nic_work_once():
    p = ideal(kappa=1e-9, eta=1.0, gamma=0.0)
    c = cluster(hosts=2, ranks_per_host=8, cores=8.0, nic_bps=1e12, flow_bps=1e12)
    flat = m.proxy_cpu_rate(c, m.Plane(k=1), p)
    hier = m.proxy_cpu_rate(c, m.Plane(k=1, hierarchical=True), p)
    assert hier == pytest.approx(8 * flat)


def test_zero_configuration_rule_follows_the_probe_knee():
    p = m.Params(goodput=1.0)
    aws25 = m.Cluster(hosts=4, nic_bps=25e9, flow_bps=5e9, cores=48)
    aws100 = m.Cluster(hosts=4, nic_bps=100e9, flow_bps=5e9, cores=96)
    assert m.zero_config_plane(aws25, p).S == 2      # knee 8 flows over 4 lanes
    assert m.zero_config_plane(aws100, p).S == 8     # knee 32 flows
    emu = m.Cluster.emulated("4:1gbit:200mbit")
    assert m.zero_config_plane(emu, p).S == 2        # as the probe chose there (docs/dataplane.md)


def test_cpu_bound_k():
    p = ideal(kappa=1e-9, eta=1.0, gamma=0.0)
    c = cluster(nic_bps=8 * 4e9, flow_bps=8 * 4e9, cores=100.0)  # 4 GB/s link; one proxy carries 1 GB/s
    out = m.cpu_bound_k(c, p, S=1, max_k=8)
    assert out["k_fill"] == 4 and out["k_cpu"] == 1


# -- training ----------------------------------------------------------------------------------


def profile(buckets, fwd=1.0, bwd=2.0, upd=0.5):
    return tr.Profile(fwd, bwd, upd, buckets, batch_per_rank=10)


def test_ssgd_hides_what_fits_under_backward():
    prof = profile([(100.0, 0.5), (100.0, 1.0)])
    out = tr.ssgd_step(prof, lambda b: b / 200.0)  # each allreduce 0.5 s
    assert out["step_s"] == pytest.approx(3.5)      # both end by 1.5 < backward's 2.0
    slow = tr.ssgd_step(prof, lambda b: b / 50.0)   # 2 s each: 0.5..2.5, 2.5..4.5
    assert slow["step_s"] == pytest.approx(1.0 + 4.5 + 0.5)
    assert tr.images_per_s(slow["step_s"], prof, n=4) == pytest.approx(40 / 6.0)


def test_od_sgd_steady_state_is_max_of_compute_and_comm():
    prof = profile([(100.0, 0.0)])
    assert tr.delayed_period(prof, lambda t: prof.buckets, lambda b: 1.0)["step_s"] == pytest.approx(3.5)
    assert tr.delayed_period(prof, lambda t: prof.buckets, lambda b: 6.0)["step_s"] == pytest.approx(6.0)


def test_ssd_sgd_and_cd_sgd():
    prof = profile([(160.0, 2.0)])
    algos = tr.policies(prof, allreduce=lambda b: b / 10.0, allgather=lambda b: b / 10.0, n=4, period=4,
                        correction=1000)
    # SSD-SGD: one 16 s allreduce per 4 steps of 3.5 s: max(14, 16) / 4
    assert algos["ssd-sgd"]["step_s"] == pytest.approx(4.0, rel=0.02)
    # CD-SGD: payload 160/16 = 10 B -> 1 s allgather, hidden behind the next step
    assert algos["cd-sgd"]["step_s"] == pytest.approx(3.5, rel=0.01)
    assert algos["ssgd"]["step_s"] == pytest.approx(1 + 2 + 16 + 0.5)


def test_profile_from_trace(tmp_path):
    lines = [{"format": "fasthorovod-trace", "version": 1, "kind": "worker", "rank": 0, "size": 2}]
    for step in range(3):
        t = step * 10_000_000_000
        lines += [{"k": "forward", "n": "", "t": t, "d": 1_000_000_000, "step": step},
                  {"k": "backward", "n": "", "t": t + 1_000_000_000, "d": 2_000_000_000, "step": step},
                  {"k": "request", "n": "b0", "t": t + 1_500_000_000, "step": step, "bytes": 4000, "proxied": True},
                  {"k": "request", "n": "b1", "t": t + 3_000_000_000, "step": step, "bytes": 8000, "proxied": True},
                  {"k": "update", "n": "", "t": t + 4_000_000_000, "d": 500_000_000, "step": step}]
    (tmp_path / "rank0.worker.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    prof = tr.profile_from_trace(str(tmp_path), skip=1, batch_per_rank=16)
    assert (prof.forward_s, prof.backward_s, prof.update_s) == pytest.approx((1.0, 2.0, 0.5))
    assert prof.buckets == [(4000.0, pytest.approx(0.5)), (8000.0, pytest.approx(2.0))]


def test_published_profiles_are_whole_models():
    for name, w in tr.WORKLOADS.items():
        prof = tr.published_profile(name)
        assert prof.gradient_bytes == pytest.approx(4 * w["params"], rel=0.02)
        assert prof.compute_s == pytest.approx(w["compute_s"])
        assert all(b <= 25 * MiB or len(prof.buckets) >= 1 for b, _ in prof.buckets)


# -- fitting and the CLI -------------------------------------------------------------------------


TRUTH = dict(t0_fh=3e-3, alpha_fh=1e-3, kappa_net=4e-9, t0_hvd=5e-3, alpha_hvd=2e-3, hvd_eff=0.9, goodput=0.95)


def synthetic_observations():
    p = m.Params(**TRUTH)
    rows = []
    for spec in ("2:1gbit:200mbit", "3:1gbit:200mbit", "4:1gbit:200mbit"):
        c = m.Cluster.emulated(spec, background_cores=0.2)
        for size in (2 * MiB, 8 * MiB, 32 * MiB):
            for backend in ("horovod", "fasthorovod"):
                if backend == "horovod":
                    t = m.horovod_allreduce(size, c, p)["seconds"]
                else:
                    t = m.fasthorovod_allreduce(size, c, m.Plane(k=4, S=2, threshold=64 << 10), p)["seconds"]
                rows.append({"spec": spec, "hosts": c.hosts, "backend": backend, "bytes": size, "seconds": t,
                             "k": 4, "S": 2, "background_cores": 0.2,
                             "probe_one_flow_Bps": 0.95 * c.flow_Bps})
    return rows


def test_fit_recovers_the_parameters_that_made_the_data():
    p = fitting.fit(synthetic_observations(), m.Params())
    assert p.goodput == pytest.approx(0.95)
    assert p.hvd_eff == pytest.approx(0.9, rel=0.02)
    assert p.kappa_net == pytest.approx(4e-9, rel=0.15)
    res = fitting.residuals(synthetic_observations(), p, 2.0, 64 << 10)
    assert fitting.summary(res)["max_abs"] < 0.05  # kappa_net on a grid of 12 per decade


def test_cli_end_to_end_on_a_tiny_calibration(tmp_path, capsys):
    reuse = tmp_path / "old.json"
    reuse.write_text(json.dumps({"observations": synthetic_observations()}))
    model = tmp_path / "model.json"
    assert cli.main(["calibrate", "--clouds", "--skip-micro", "--reuse", str(reuse), "--out", str(model)]) == 0
    doc = json.loads(model.read_text())
    assert doc["residuals"] and doc["residual_summary"]["fasthorovod"]["max_abs"] < 0.05
    capsys.readouterr()
    assert cli.main(["predict", "--model", str(model), "--emulated", "4:1gbit:200mbit", "--size", "16MiB",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["allreduce"][0]
    assert row["fasthorovod"]["busbw"] > row["horovod"]["busbw"] > 0
    proj = tmp_path / "proj.json"
    assert cli.main(["project", "--model", str(model), "--workloads", "resnet50", "--gpus", "16", "256",
                     "--nics", "25gbit", "--cores", "48", "--out", str(proj)]) == 0
    rows = json.loads(proj.read_text())["rows"]
    assert [r["gpus"] for r in rows] == [16, 256]
    for r in rows:
        assert r["fasthorovod ssgd"]["low"] <= r["fasthorovod ssgd"]["images_per_s"] <= r["fasthorovod ssgd"]["high"]
        assert r["fasthorovod ssgd"]["images_per_s"] <= r["ideal"] * 1.0001


def test_predict_help_documents_the_inputs():
    out = subprocess.run([sys.executable, "-m", "fasthorovod.sim", "predict", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--hosts", "--ranks-per-host", "--nic", "--per-flow", "--rtt", "--cores", "--proxies",
                 "--sockets", "--hierarchical", "--size", "--trace"):
        assert flag in out.stdout


def test_a_saved_sweep_with_an_uneven_cloud_is_checked_on_its_even_clouds(tmp_path, capsys):
    from fasthorovod.sim import cli

    def network(spec):
        cfg = {"backend": "fasthorovod:4x2", "status": "ok",
               "result": {"data_plane": {"lanes": 4, "sockets_per_lane": 2},
                          "results": [{"bytes": 64 << 20, "median_s": 1.0}]}}
        return {"network": spec, "np": 4, "configs": [cfg]}

    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"networks": [network("4:1gbit:200mbit"), network("4:1gbit:200mbit,host1=100mbit")]}))
    rows = cli.sweep_check(str(path), m.Params(), 2.0, 64 << 10)
    assert [r["spec"] for r in rows] == ["4:1gbit:200mbit"]
    assert "4:1gbit:200mbit,host1=100mbit left out (the model takes even clouds only)" in capsys.readouterr().out


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_background_cpu_leaves_out_processes_of_the_job_in_other_network_namespaces():
    """Ranks launched over ssh on emulated hosts are no children of the job: their CPU is the job's,
    not another engineer's. A busy loop in its own network namespace, orphaned (so not our
    descendant), stands in for them."""
    from fasthorovod.sim import runs

    busy = ["unshare", "--net", "sh", "-c", "(timeout 3 sh -c 'while :; do :; done' &) ; exit 0"]
    job = ["sh", "-c", f"{shlex.join(busy)}; sleep 3.5"]
    measured = runs.run_measured(job, timeout=30)
    assert measured["rc"] == 0
    assert measured["background_cores"] < 0.35, measured  # the busy loop took ~0.85 of a core

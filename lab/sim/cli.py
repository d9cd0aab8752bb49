"""python -m lab.sim {predict, calibrate, validate, project}: see lab/scale.md."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import sys
import time
from typing import Dict, List, Optional

from fasthorovod.units import bytes_argument, rate_argument
from lab.sim import fit as fitting
from lab.sim import model as m
from lab.sim import training as tr
from lab.sim import waits as waits_mod

MiB = 1 << 20
parse_size = bytes_argument  # sizes and rates as everywhere in the repository: fasthorovod/units.py
parse_rate = rate_argument


def parse_seconds(text: str) -> float:
    t = text.strip().lower()
    for suffix, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * scale
    return float(t)


def _load_params(path: Optional[str]) -> m.Params:
    return m.Params.load(path) if path else m.Params()


def _gbps(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8e-9:.3f}"


def _table(headers: List[str], rows: List[List]) -> str:
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _write(path: Optional[str], doc: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")


# -- predict ------------------------------------------------------------------------------------


def add_cluster_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("cluster")
    g.add_argument("--hosts", type=int, default=4, help="hosts (default: %(default)s)")
    g.add_argument("--ranks-per-host", type=int, default=1, help="ranks (GPUs) per host (default: %(default)s)")
    g.add_argument("--nic", type=parse_rate, default=1e9, metavar="RATE",
                   help="NIC rate per host and direction, tc units: 25gbit (default: 1gbit)")
    g.add_argument("--per-flow", type=parse_rate, default=2e8, metavar="RATE",
                   help="per-flow cap (AWS: 5gbit outside a placement group) (default: 200mbit)")
    g.add_argument("--rtt", type=parse_seconds, default=5e-5, metavar="TIME",
                   help="round trip between hosts: 100us, 0.5ms (default: 50us)")
    g.add_argument("--cores", type=float, default=2, help="cores per host (default: %(default)s)")
    g.add_argument("--shared-cores", action="store_true",
                   help="all hosts share --cores (the emulated cloud on one machine)")
    g.add_argument("--background-cores", type=float, default=0.0,
                   help="cores other jobs take (per host, or of the shared machine) (default: 0)")
    g.add_argument("--compute-cores", type=float, default=0.0,
                   help="cores each rank's training keeps busy while it communicates (default: 0)")
    g.add_argument("--flow-buckets", type=int, default=None,
                   help="per-flow caps hashed into this many buckets per server port (emulated cloud: 16); "
                        "default: every flow its own cap")
    g.add_argument("--stage-rate", type=parse_rate, default=None, metavar="RATE",
                   help="rate of the copy into and out of the proxies' memory in bit/s (a GPU's PCIe, e.g. "
                        "96gbit); default: a CPU memcpy at the model's copy cost")
    g.add_argument("--emulated", metavar="SPEC", help="shorthand for an emulated cloud HOSTS:LINK:PER_FLOW on this "
                   "machine (sets hosts, nic, per-flow, shared cores, 16 flow buckets)")
    d = ap.add_argument_group("data plane (FastHorovod)")
    d.add_argument("-k", "--lanes", "--proxies", type=int, default=None,
                   help="lanes per rank, a lane being one proxy process (--proxies: its former name); "
                        "default: the zero-configuration rule (4)")
    d.add_argument("-S", "--sockets", type=int, default=None,
                   help="sockets per lane; default: what the start-up probe would choose on this cluster")
    d.add_argument("--hierarchical", action="store_true",
                   help="the hierarchical allreduce (FastHorovod's default with several ranks per host: "
                        "shared-memory reduce-scatter/allgather inside a host, one ring of M/P per local rank "
                        "across hosts, all P*k lanes on the NIC); default: flat, one ring of all ranks per lane "
                        "(FASTHOROVOD_HIERARCHICAL=0, and what one rank per host runs)")
    d.add_argument("--sequential-local", action="store_true",
                   help="hierarchical: the shared-memory phases before and after the ring, not overlapped with it "
                        "(the version measured in docs/hierarchical.md, before commit 836aa67)")
    d.add_argument("--threshold", type=parse_size, default=1 << 20,
                   help="allreduces smaller than this go through Horovod (default: 1MiB)")
    d.add_argument("--striping", choices=["least-left", "first-free"], default="least-left",
                   help="how a lane hands frames to its sockets: least-left (since commit 636c542: chunks cut into "
                        ">= S segments of >= 64 KiB, each frame to the socket with the least left to send) or "
                        "first-free (before it: 1 MiB segments; to predict measurements made before 2026-12-02 "
                        "16:31 UTC) (default: %(default)s)")


def cluster_from_args(a) -> m.Cluster:
    if a.emulated:
        c = m.Cluster.emulated(a.emulated, ranks_per_host=a.ranks_per_host, cores=a.cores,
                               background_cores=a.background_cores)
        return dataclasses.replace(c, compute_cores=a.compute_cores)
    return m.Cluster(hosts=a.hosts, ranks_per_host=a.ranks_per_host, nic_bps=a.nic, flow_bps=a.per_flow,
                     rtt_s=a.rtt, cores=a.cores, shared_cores=a.cores if a.shared_cores else None,
                     background_cores=a.background_cores, compute_cores=a.compute_cores,
                     flow_buckets=a.flow_buckets, stage_rate=a.stage_rate / 8 if a.stage_rate else None)


def plane_from_args(a, c: m.Cluster, p: m.Params) -> m.Plane:
    auto = m.zero_config_plane(c, p, k=a.lanes, threshold=a.threshold)
    return m.Plane(k=a.lanes or auto.k, S=a.sockets or auto.S, hierarchical=a.hierarchical, threshold=a.threshold,
                   local_overlap=not a.sequential_local, striping=a.striping)


def cmd_predict(a) -> int:
    p = _load_params(a.model)
    c = cluster_from_args(a)
    plane = plane_from_args(a, c, p)
    doc = {"cluster": dataclasses.asdict(c), "plane": dataclasses.asdict(plane), "params_from": a.model or "defaults",
           "allreduce": []}
    rows = []
    for size in a.size:
        h = m.horovod_allreduce(size, c, p)
        f = m.fasthorovod_allreduce(size, c, plane, p)
        doc["allreduce"].append({"bytes": size, "horovod": h, "fasthorovod": f})
        rows.append([_fmt_size(size), f"{h['seconds'] * 1e3:.2f}", _gbps(h["busbw"]), h["bound"],
                     f"{f['seconds'] * 1e3:.2f}", _gbps(f["busbw"]), f"{f['bound']} ({f['path']})",
                     f"{h['seconds'] / f['seconds']:.2f}x", f"{f.get('p_unlucky_ports', 0.0):.2f}"])
    kk = m.cpu_bound_k(c, p, hierarchical=plane.hierarchical)
    doc["cpu_bound_k"] = kk
    if a.trace:
        prof = tr.profile_from_trace(a.trace, skip=a.skip, batch_per_rank=a.batch)
        doc["training"] = training_prediction(prof, c, plane, p, a.period, a.correction)
    if a.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
        return 0
    print(f"cluster: {c.hosts} hosts x {c.ranks_per_host} ranks, NIC {c.nic_bps / 1e9:g} Gbit/s, per flow "
          f"{c.flow_bps / 1e9:g} Gbit/s, RTT {c.rtt_s * 1e6:.0f} us, {c.cores:g} cores"
          f"{' (shared by all hosts)' if c.shared_cores else ' per host'}")
    print(f"FastHorovod: k={plane.k} lanes x S={plane.S} sockets, {'hierarchical' if plane.hierarchical else 'flat'}; "
          f"proxies stop paying at k={kk['k_fill']} (CPU-bound from k={kk['k_cpu']})")
    print(_table(["size", "Horovod ms", "busbw Gbit/s", "bound", "FastHorovod ms", "busbw Gbit/s", "bound",
                  "speed-up", "p unlucky ports"], rows))
    if a.trace:
        t = doc["training"]
        print(f"\ntraining from {a.trace}: compute {t['compute_s']:.3f} s/step, gradients "
              f"{t['gradient_bytes'] / 1e6:.1f} MB in {t['buckets']} buckets, batch {a.batch} per rank")
        print(_table(["algorithm", "s/step", "images/s", "exposed comm s"],
                     [[k, f"{v['step_s']:.3f}", f"{v['images_per_s']:.1f}", f"{v['exposed_s']:.3f}"]
                      for k, v in t["algorithms"].items()]))
    return 0


def training_prediction(prof: tr.Profile, c: m.Cluster, plane: m.Plane, p: m.Params, period: int = 5,
                        correction: int = 5, comm_scale: float = 1.0, decode_rate: Optional[float] = None) -> Dict:
    n = c.ranks
    hvd = lambda b: comm_scale * m.horovod_allreduce(b, c, p)["seconds"]  # noqa: E731
    fh = lambda b: comm_scale * m.fasthorovod_allreduce(b, c, plane, p)["seconds"]  # noqa: E731
    ag = lambda b: comm_scale * m.allgather_seconds(b, c, plane, p)  # noqa: E731
    algos = {"horovod": tr.ssgd_step(prof, hvd)}
    for name, v in tr.policies(prof, fh, ag, n, period, correction,
                               decode_rate or 1.0 / p.reduce_cost).items():
        algos["fasthorovod " + name] = v
    for v in algos.values():
        v["images_per_s"] = tr.images_per_s(v["step_s"], prof, n)
    return {"compute_s": prof.compute_s, "gradient_bytes": prof.gradient_bytes, "buckets": len(prof.buckets),
            "ideal_images_per_s": tr.images_per_s(prof.compute_s, prof, n), "algorithms": algos}


def _fmt_size(n: float) -> str:
    for unit, s in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= s and n % s == 0:
            return f"{int(n // s)}{unit}"
    return f"{n / 1e6:.1f}MB"


# -- calibrate ----------------------------------------------------------------------------------


CALIBRATION_JOBS = ["2:1gbit:200mbit", "3:1gbit:200mbit=horovod", "4:1gbit:200mbit", "5:1gbit:200mbit=fasthorovod",
                    "5:500mbit:100mbit=fasthorovod"]


TRACE_WAIT_CLOUDS = ["4:1gbit:200mbit", "5:1gbit:200mbit"]


def split_job(entry: str, default: str = "horovod,fasthorovod"):
    """'HOSTS:LINK:PER_FLOW' or 'HOSTS:LINK:PER_FLOW=BACKENDS' (benchmarks/allreduce.py's --backends,
    e.g. '4:1gbit:200mbit=fasthorovod:8x1') -> (spec, backends)."""
    spec, _, backends = entry.partition("=")
    return spec.strip(), (backends.strip() or default)


def cmd_calibrate(a) -> int:
    from lab.sim import runs

    start = time.monotonic()
    prior = _load_params(a.prior)
    if a.placement_model:
        pm = json.load(open(a.placement_model))
        pm = pm.get("model", pm)
        prior = dataclasses.replace(prior, kappa=pm["kappa"], eta=pm["eta"], gamma=pm["gamma"])
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv), "jobs": [], "observations": []}
    if not a.skip_micro:
        costs = runs.unit_costs()
        doc["unit_costs"] = costs
        prior = dataclasses.replace(prior, reduce_cost=costs["reduce"], copy_cost=costs["copy"],
                                    socket_cost=costs["socket"])
        print(f"unit costs (ns/B): reduce {costs['reduce'] * 1e9:.3f}, copy {costs['copy'] * 1e9:.3f}, "
              f"loopback TCP {costs['socket'] * 1e9:.3f}", flush=True)
    obs: List[Dict] = []
    for path in a.reuse or []:
        with open(path) as f:
            old = json.load(f)
        striping = m.striping_at(old.get("date"))  # the data plane of the reused run's day
        obs.extend(dict(o, striping=o.get("striping") or striping) for o in old.get("observations", [])
                   if not (o.get("source") and a.sweep))
        if a.skip_micro and old.get("unit_costs") and "unit_costs" not in doc:  # the reused run's own
            costs = doc["unit_costs"] = old["unit_costs"]
            prior = dataclasses.replace(prior, reduce_cost=costs["reduce"], copy_cost=costs["copy"],
                                        socket_cost=costs["socket"])
        for job in old.get("jobs", []):
            doc["jobs"].append(dict(job, reused_from=path))
    for path in a.sweep or []:
        rows = sweep_rows(path, a.sweep_clouds)
        print(f"{len(rows)} observations from the saved sweep {path}", flush=True)
        obs.extend(rows)
    for entry in a.clouds:
        spec, backends = split_job(entry)
        ceiling = "=" not in entry and not a.no_ceiling  # the main clouds: also the raw-TCP ring ceiling
        print(f"[{time.monotonic() - start:5.0f} s] allreduce on {spec} ({backends}{', ceiling' if ceiling else ''}) ...",
              flush=True)
        for job in runs.cloud_jobs(spec, backends, a.sizes, rounds=a.rounds, ceiling=ceiling, iters=a.iters,
                                   warmup=1, timeout=a.job_timeout, threshold=a.threshold):
            rows = runs.observations(job)
            doc["jobs"].append({k: job[k] for k in ("spec", "hosts", "argv", "measure")})
            ceil = runs.ceiling_Bps(job)
            print(f"  {len(rows)} observations, {job['measure']['seconds']:.0f} s, other jobs' CPU "
                  f"{job['measure']['background_cores']:.2f} cores"
                  + (f", raw-TCP ring ceiling {ceil * 8e-9:.3f} Gbit/s" if ceil else "")
                  + ("" if rows else f"; tail: {job['measure']['tail'][-3:]}"), flush=True)
            obs.extend(rows)
    waits = None
    for path in a.reuse or []:  # the reused run's measured waits, unless measured again below
        with open(path) as f:
            waits = json.load(f).get("trace_waits") or waits
    if a.trace_waits is None:  # by default with the allreduce jobs, not on a refit of reused observations
        a.trace_waits = TRACE_WAIT_CLOUDS if a.clouds else []
    if a.trace_waits:
        import tempfile

        rows, per_cloud = [], []
        for spec in a.trace_waits:
            print(f"[{time.monotonic() - start:5.0f} s] frame trace on {spec} (fasthorovod 4x2, "
                  f"{','.join(_fmt_size(x) for x in a.trace_sizes)}) ...", flush=True)
            root = tempfile.mkdtemp(prefix="fhvd-sim-waits-")
            job = runs.allreduce_job(spec, a.trace_sizes, "fasthorovod:4x2+trace", iters=a.iters + 3, warmup=1,
                                     timeout=a.job_timeout, threshold=a.threshold, trace_root=root)
            tdir = os.path.join(root, "fasthorovod_4x2_trace")
            got = waits_mod.frame_waits(tdir) if os.path.isdir(tdir) else []
            flow = prior.goodput * m.Cluster.emulated(spec).flow_Bps
            for r in got:
                r["flow_Bps"] = flow
            rows.extend(got)
            per_cloud.append({"spec": spec, "frames": len(got), "measure": job["measure"], "argv": job["argv"],
                              "fit": waits_mod.fit_waits(got, flow)})
            shutil.rmtree(root, ignore_errors=True)
            print(f"  {len(got)} frames, {job['measure']['seconds']:.0f} s, other jobs' CPU "
                  f"{job['measure']['background_cores']:.2f} cores", flush=True)
        both = waits_mod.fit_waits(rows, 1.0)
        if both:
            waits = dict(both, clouds=per_cloud, sizes=a.trace_sizes)
            waits.pop("flow_Bps", None)
    alpha = None
    if waits:
        # The rings go socket by socket (model.socket_ring_seconds): a frame's wait behind another chain's
        # frame comes out of the lanes' sockets, given what the network holds for a flow (Q, from the traces);
        # what is left is the wait of a chain alone on its lane (one segment per chunk: the 1 MiB frames),
        # its mean and spread measured, less half the cloud's round trip that the model adds.
        one = (waits.get("mean_delay_s") or {}).get("one chain")
        prior = dataclasses.replace(prior, queue_frames=0.0, queue_bytes=waits["queue_bytes"],
                                    wait_cv=waits.get("cv_one_chain") or 1.0)
        if one is not None and not a.fit_alpha:
            alpha = max(0.0, one - m.Cluster.emulated(CALIBRATION_JOBS[0].split("=")[0]).rtt_s / 2)
        doc["trace_waits"] = waits
        cap = "no cap" if waits["queue_bytes"] is None else f"{waits['queue_bytes'] / 1024:.0f} KiB"
        print(f"chain waits from frame traces ({waits['frames']} frames): alone on a lane "
              f"{(one or 0) * 1e3:.2f} ms (cv {prior.wait_cv:.2f}); the network holds up to {cap} per flow",
              flush=True)
    if a.background_scale != 1.0:
        for o in obs:
            o["background_cores_measured"] = o.get("background_cores_measured", o.get("background_cores", 0.0))
            o["background_cores"] = a.background_scale * o["background_cores_measured"]
    doc["observations"] = obs
    alpha = getattr(a, "alpha_fh_fixed", None) or alpha
    params = fitting.fit(obs, prior, cores=a.machine_cores, threshold=a.threshold, alpha_fh=alpha) if obs else prior
    res = fitting.residuals(obs, params, a.machine_cores, a.threshold)
    params.meta = {"fitted_on": sorted({o["spec"] for o in obs}), "machine_cores": a.machine_cores,
                   "threshold": a.threshold}
    doc["params"] = params.to_json()
    doc["residuals"] = res
    doc["residual_summary"] = {b: fitting.summary([r for r in res if r["backend"].startswith(b)])
                               for b in ("horovod", "fasthorovod")}
    doc["seconds"] = round(time.monotonic() - start, 1)
    _write(a.out, doc)
    print(params_table(params))
    if res:
        print(residual_table(res))
    print(f"calibration in {doc['seconds']:.0f} s" + (f", written to {a.out}" if a.out else ""))
    return 0


def params_table(p: m.Params) -> str:
    rows = [["kappa (proxy CPU per wire byte)", f"{p.kappa * 1e9:.3f} ns/B"],
            ["eta (proxy's busy fraction)", f"{p.eta:.3f}"], ["gamma (per extra busy thread on a core)", f"{p.gamma:.3f}"],
            ["kappa_net (network stack per byte)", f"{p.kappa_net * 1e9:.3f} ns/B"],
            ["copy / reduce / loopback TCP", f"{p.copy_cost * 1e9:.3f} / {p.reduce_cost * 1e9:.3f} / "
                                             f"{p.socket_cost * 1e9:.3f} ns/B"],
            ["goodput (of a configured rate)", f"{p.goodput:.3f}"],
            ["FastHorovod t0 / alpha", f"{p.t0_fh * 1e3:.2f} ms / {p.alpha_fh * 1e3:.3f} ms"],
            ["Horovod t0 / alpha", f"{p.t0_hvd * 1e3:.2f} ms / {p.alpha_hvd * 1e3:.3f} ms"],
            ["Horovod share of one flow", f"{p.hvd_eff:.3f}"],
            ["kappa_gloo (Horovod CPU per wire byte)", f"{p.kappa_gloo * 1e9:.3f} ns/B"]]
    return _table(["parameter", "value"], rows)


def residual_table(res: List[Dict]) -> str:
    return _table(["cloud", "backend", "plane (jobs)", "size", "measured Gbit/s", "predicted Gbit/s", "error",
                   "other CPU"],
                  [[r["spec"], r["backend"], f"{r['k']}x{r['S']} ({r.get('rounds', 1)})" if "k" in r else "-",
                    _fmt_size(r["bytes"]), f"{r['measured_busbw_gbps']:.3f}",
                    f"{r['predicted_busbw_gbps']:.3f}", f"{-r['error'] / (1 + r['error']) * 100:+.1f}%",
                    f"{r['background_cores']:.2f}"] for r in res])


# -- validate -----------------------------------------------------------------------------------


def sweep_rows(path: str, only: Optional[List[str]] = None, background: float = 0.0) -> List[Dict]:
    """Observations (one per k x S cell) of a saved benchmarks/sweep.py result, on the clouds in
    `only` (None: all). Networks the model cannot describe (uneven clouds: per-host rates) are left
    out, with a line."""
    from fasthorovod.netem.spec import parse_spec

    doc = json.load(open(path))
    striping = m.striping_at(doc.get("date"))  # sweeps measured before commit 636c542: "first-free"
    rows = []
    for net in doc.get("networks", []):
        spec = net["network"].split("--emulate-cloud")[-1].strip() if "--emulate-cloud" in net["network"] else net["network"]
        if only is not None and spec not in only:
            continue
        try:
            uneven = parse_spec(spec).uneven
        except ValueError:  # not a cloud spec; the model says what it makes of it below
            uneven = False
        if uneven:
            print(f"saved sweep: {spec} left out (the model takes even clouds only)", flush=True)
            continue
        ceil = net.get("ceiling") or {}
        for cfg in net.get("configs", []):
            if cfg.get("status") != "ok" or not cfg["backend"].startswith("fasthorovod"):
                continue
            plane = cfg["result"].get("data_plane") or {}
            r = cfg["result"]["results"][0]
            rows.append({"spec": spec, "hosts": net.get("np"), "backend": cfg["backend"], "bytes": r["bytes"],
                         "seconds": r["median_s"], "k": plane.get("lanes"), "S": plane.get("sockets_per_lane"),
                         "background_cores": background, "source": path, "striping": striping,
                         "ceiling_Bps": ceil["mean_gbps"] * 1e9 / 8 if ceil.get("status") == "ok" else None})
    return rows


def sweep_check(path: str, p: m.Params, cores: float, threshold: int, background: float = 0.0,
                only: Optional[List[str]] = None) -> List[Dict]:
    """Predicts every configuration of a saved benchmarks/sweep.py result (k x S grid, one size)."""
    return fitting.residuals(sweep_rows(path, only, background), p, cores, threshold)


def cmd_validate(a) -> int:
    from lab.sim import runs

    p = m.Params.load(a.model)
    threshold = p.meta.get("threshold", 64 << 10)
    cores = p.meta.get("machine_cores", 2.0)
    start = time.monotonic()
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv), "model": a.model, "params": p.to_json(), "allreduce": [], "training": []}
    for path in a.saved_sweep or []:
        res = sweep_check(path, p, cores, threshold, a.saved_background, a.saved_clouds)
        doc.setdefault("saved_sweeps", []).append({"path": path, "background_cores": a.saved_background,
                                                   "rows": res, "summary": fitting.summary(res)})
        print(f"saved sweep {path} (measured earlier; other jobs' CPU assumed {a.saved_background:g}):")
        print(residual_table(res), flush=True)
    for spec in a.clouds:
        print(f"[{time.monotonic() - start:5.0f} s] allreduce on {spec} ...", flush=True)
        for job in runs.cloud_jobs(spec, "horovod,fasthorovod", a.sizes, rounds=a.rounds, iters=a.iters, warmup=1,
                                   timeout=a.job_timeout, threshold=threshold):
            rows = runs.observations(job)
            res = fitting.residuals(rows, p, cores, threshold)
            for r, o in zip(res, rows):
                r["round_seconds"] = o.get("round_seconds")
            doc["allreduce"].append({"spec": spec, "measure": job["measure"], "argv": job["argv"], "rows": res})
            if not rows:
                print(f"  no results: {job['measure']['tail'][-4:]}", flush=True)
            else:
                print(residual_table(res), flush=True)
            _write(a.out, doc)
    if a.train_cloud:
        import tempfile

        print(f"[{time.monotonic() - start:5.0f} s] {a.train_model} on {a.train_cloud} ...", flush=True)
        from fasthorovod.netem.spec import parse_spec

        np_ = parse_spec(a.train_cloud).hosts
        root = a.trace_root or tempfile.mkdtemp(prefix="fhvd-sim-trace-")
        job = runs.train_job(a.train_cloud, np_, a.train_model, "horovod,fasthorovod+trace", a.steps, 1, root,
                             timeout=a.job_timeout)
        entry = {"spec": a.train_cloud, "argv": job["argv"], "measure": job["measure"], "trace": root}
        rep = job.get("report") or {}
        measured = {e["backend"]: e["result"]["step_s"] for e in rep.get("backends", []) if e.get("status") == "ok"}
        entry["measured_step_s"] = measured
        tdir = os.path.join(root, "fasthorovod_trace")
        if os.path.isdir(tdir) and measured:
            prof = tr.profile_from_trace(tdir, skip=1, batch_per_rank=16)
            plane_info = next((e["result"].get("data_plane") for e in rep["backends"]
                               if e["backend"].startswith("fasthorovod") and e.get("status") == "ok"), None) or {}
            c = m.Cluster.emulated(a.train_cloud, cores=cores, background_cores=job["measure"]["background_cores"])
            plane = m.Plane(k=int(plane_info.get("lanes") or 4), S=int(plane_info.get("sockets_per_lane") or 1))
            pred = training_prediction(prof, c, plane, p)
            entry["profile"] = prof.to_json()
            entry["predicted"] = {"horovod": pred["algorithms"]["horovod"]["step_s"],
                                  "fasthorovod+trace": pred["algorithms"]["fasthorovod ssgd"]["step_s"]}
            entry["errors"] = {b: (entry["predicted"][b] - measured[b]) / measured[b]
                               for b in entry["predicted"] if b in measured}
            entry["all_algorithms"] = pred
            print(_table(["backend", "measured s/step", "predicted s/step", "error"],
                         [[b, f"{measured[b]:.2f}", f"{entry['predicted'][b]:.2f}", f"{entry['errors'][b] * 100:+.1f}%"]
                          for b in entry["errors"]]), flush=True)
        else:
            print(f"  no trace or no result: {job['measure']['tail'][-4:]}", flush=True)
        doc["training"].append(entry)
    doc["seconds"] = round(time.monotonic() - start, 1)
    allres = [r for x in doc["allreduce"] for r in x["rows"]]
    doc["summary"] = {"allreduce": fitting.summary(allres),
                      "training": [e.get("errors") for e in doc["training"]]}
    _write(a.out, doc)
    print(f"validation in {doc['seconds']:.0f} s" + (f", written to {a.out}" if a.out else ""))
    return 0


# -- project ------------------------------------------------------------------------------------


def cmd_project(a) -> int:
    p = _load_params(a.model)
    band = a.band
    if band is None and a.validation:
        v = json.load(open(a.validation))
        errs = [abs(r["error"]) for x in v.get("allreduce", []) for r in x["rows"]]
        errs += [abs(e) for t in v.get("training", []) for e in (t.get("errors") or {}).values()]
        band = max(errs) if errs else 0.15
    band = 0.15 if band is None else band
    kappa_lane = p.kappa_lane if a.keep_kappa_lane else p.kappa
    rows, doc = [], {"params_from": a.model or "defaults", "band": band, "assumptions": {
        "ranks_per_host": 8, "rtt_s": a.rtt, "stage_rate_Bps": a.stage_rate / 8, "compute_cores_per_rank": 1,
        "kappa_net": p.kappa_net if a.keep_kappa_net else 0.0, "kappa_lane": kappa_lane, "goodput": a.goodput,
        "link_goodput": a.goodput}, "rows": []}
    q = dataclasses.replace(p, kappa_net=p.kappa_net if a.keep_kappa_net else 0.0, goodput=a.goodput,
                            link_goodput=a.goodput, kappa_lane=kappa_lane)
    if not a.keep_latency:  # the emulator's latency: its scheduler's and its shapers' queues (lab/scale.md)
        d = m.Params()
        q = dataclasses.replace(q, t0_fh=d.t0_fh, alpha_fh=d.alpha_fh, t0_hvd=d.t0_hvd, alpha_hvd=d.alpha_hvd,
                                queue_frames=d.queue_frames, queue_bytes=d.queue_bytes)
    doc["assumptions"].update(t0_fh=q.t0_fh, alpha_fh=q.alpha_fh, t0_hvd=q.t0_hvd, alpha_hvd=q.alpha_hvd,
                              queue_frames=q.queue_frames, queue_bytes=q.queue_bytes, wait_cv=q.wait_cv)
    for wl in a.workloads:
        prof = tr.published_profile(wl, compute_factor=a.compute_factor)
        for nic in a.nics:
            for cores in a.cores:
                for gpus in a.gpus:
                    c = m.Cluster(hosts=max(1, gpus // 8), ranks_per_host=min(8, gpus), nic_bps=nic,
                                  flow_bps=a.per_flow, rtt_s=a.rtt, cores=cores, compute_cores=1.0,
                                  stage_rate=a.stage_rate / 8)
                    plane = m.zero_config_plane(c, q)
                    hier = dataclasses.replace(plane, hierarchical=True)
                    kk = m.cpu_bound_k(c, q, S=plane.S, hierarchical=True)
                    out = {"workload": wl, "gpus": gpus, "nic_gbps": nic / 1e9, "cores": cores, "k": plane.k,
                           "S": plane.S, "k_fill": kk["k_fill"], "k_cpu": kk["k_cpu"]}
                    for label, pl in (("flat", plane), ("hier", hier)):
                        mid = training_prediction(prof, c, pl, q, decode_rate=a.decode_rate)
                        lo = training_prediction(prof, c, pl, q, comm_scale=1 + band, decode_rate=a.decode_rate)
                        hi = training_prediction(prof, c, pl, q, comm_scale=max(0.0, 1 - band), decode_rate=a.decode_rate)
                        for name in mid["algorithms"]:
                            key = name if label == "flat" else name + " (hier)"
                            if label == "hier" and name == "horovod":
                                continue
                            out[key] = {"images_per_s": mid["algorithms"][name]["images_per_s"],
                                        "low": lo["algorithms"][name]["images_per_s"],
                                        "high": hi["algorithms"][name]["images_per_s"]}
                        out["ideal"] = mid["ideal_images_per_s"]
                    out["bound"] = m.fasthorovod_rate(c, hier, q)["bound"]
                    out["bound_flat"] = m.fasthorovod_rate(c, plane, q)["bound"]
                    doc["rows"].append(out)
    for r in doc["rows"]:  # FastHorovod's default with 8 ranks per host is the hierarchical allreduce
        hv, fhh, fh = r["horovod"], r["fasthorovod ssgd (hier)"], r["fasthorovod ssgd"]
        rows.append([r["workload"], r["gpus"], f"{r['nic_gbps']:g}", f"{r['cores']:g}", f"{r['k']}x{r['S']}",
                     f"{hv['images_per_s']:.0f}", f"{fhh['images_per_s']:.0f} [{fhh['low']:.0f}-{fhh['high']:.0f}]",
                     f"{fhh['images_per_s'] / hv['images_per_s']:.2f}x", r["bound"],
                     f"{fh['images_per_s']:.0f}", f"{r['fasthorovod od-sgd (hier)']['images_per_s']:.0f}",
                     f"{r['fasthorovod ssd-sgd (hier)']['images_per_s']:.0f}",
                     f"{r['fasthorovod cd-sgd (hier)']['images_per_s']:.0f}",
                     f"{r['ideal']:.0f}", f"{r['k_fill']}", f"{r['k_cpu'] or '-'}"])
    headers = ["model", "GPUs", "NIC Gbit/s", "cores", "k x S", "Horovod img/s", "FastHorovod img/s [band]",
               "speed-up", "bound", "flat img/s", "OD-SGD", "SSD-SGD", "CD-SGD", "ideal", "k fill", "k CPU"]
    text = _table(headers, rows)
    print(text)
    print(f"band: communication times x (1 +/- {band:.2f})")
    _write(a.out, doc)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    if a.plot:
        try:
            from fasthorovod.extras import MissingExtraError, require

            plt_mod = require("matplotlib", "plot", "python -m lab.sim project --plot")
        except MissingExtraError as e:
            print(e, file=sys.stderr)
            return 1
        plot_projection(doc, a.plot, plt_mod)
    return 0


def plot_projection(doc: dict, path: str, matplotlib) -> None:
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in doc["rows"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 4), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        rows = [r for r in doc["rows"] if r["workload"] == wl]
        for nic in sorted({r["nic_gbps"] for r in rows}):
            cores = max(r["cores"] for r in rows)
            sel = [r for r in rows if r["nic_gbps"] == nic and r["cores"] == cores]
            g = [r["gpus"] for r in sel]
            for key, style, label in (("horovod", ":", "Horovod"), ("fasthorovod ssgd (hier)", "-", "FastHorovod"),
                                      ("fasthorovod ssgd", "--", "FastHorovod flat")):
                y = [r[key]["images_per_s"] for r in sel]
                line, = ax.plot(g, y, style, marker="o", label=f"{label} {nic:g}G")
                ax.fill_between(g, [r[key]["low"] for r in sel], [r[key]["high"] for r in sel],
                                color=line.get_color(), alpha=0.15)
        ax.plot(g, [r["ideal"] for r in sel], color="grey", lw=0.8, label="compute only")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{wl} ({max(r['cores'] for r in rows):g} cores/host)")
        ax.set_xlabel("GPUs (8 per host)")
        ax.set_ylabel("images (sequences)/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="x-small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- argument parsing ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lab.sim",
                                 description="A calibrated performance model of Horovod and FastHorovod "
                                             "(lab/scale.md).")
    sub = ap.add_subparsers(dest="command", required=True)

    pr = sub.add_parser("predict", help="allreduce time and busbw (and training step time from a trace)",
                        description="Predict allreduce time and bus bandwidth, 2(n-1)/n * bytes / time, for Horovod "
                                    "(Gloo, one flow per neighbour) and FastHorovod (k lanes x S sockets) on a "
                                    "cluster; with --trace DIR also the training step time and images/s of Horovod, "
                                    "FastHorovod SSGD, OD-SGD, SSD-SGD and CD-SGD from a FASTHOROVOD_TRACE_DIR trace.")
    pr.add_argument("--model", metavar="JSON", help="parameters written by calibrate (default: the built-in priors)")
    pr.add_argument("--size", type=parse_size, nargs="+", default=[4 * MiB, 16 * MiB, 64 * MiB],
                    help="message sizes (default: 4MiB 16MiB 64MiB)")
    add_cluster_arguments(pr)
    t = pr.add_argument_group("training")
    t.add_argument("--trace", metavar="DIR", help="a FASTHOROVOD_TRACE_DIR of a DistributedOptimizer run")
    t.add_argument("--skip", type=int, default=1, help="warm-up steps of the trace to leave out (default: 1)")
    t.add_argument("--batch", type=int, default=16, help="samples per rank per step, for images/s (default: 16)")
    t.add_argument("--period", type=int, default=5, help="SSD-SGD's period k (default: 5)")
    t.add_argument("--correction", type=int, default=5, help="CD-SGD's correction period k (default: 5)")
    pr.add_argument("--json", action="store_true", help="print everything as JSON")
    pr.set_defaults(func=cmd_predict)

    ca = sub.add_parser("calibrate", help="measure here and on emulated clouds, fit, write JSON with residuals")
    ca.add_argument("--out", default="sim-model.json", help="where to write the model (default: %(default)s)")
    ca.add_argument("--clouds", nargs="*", default=CALIBRATION_JOBS, metavar="SPEC[=BACKENDS]",
                    help="allreduce jobs on emulated clouds, one rank per host: HOSTS:LINK:PER_FLOW runs Horovod and "
                         "FastHorovod's defaults after the raw-TCP ring ceiling; SPEC=BACKENDS runs those "
                         "(benchmarks/allreduce.py --backends, e.g. fasthorovod:8x1) (default: %(default)s; none: "
                         "unit costs only)")
    ca.add_argument("--no-ceiling", action="store_true", help="do not measure the raw-TCP ring ceiling")
    ca.add_argument("--trace-waits", nargs="*", default=None, metavar="SPEC",
                    help="clouds on which a traced FastHorovod 4x2 job measures a ring chain's wait between frames "
                         "(lab/sim/waits.py; none: keep a reused run's, or no queueing term) "
                         f"(default: {' '.join(TRACE_WAIT_CLOUDS)} when --clouds runs jobs)")
    ca.add_argument("--fit-alpha", action="store_true",
                    help="fit FastHorovod's alpha on the timing data instead of taking it from the traces (the mean "
                         "wait of a chain alone on its lane); slower: the rings go socket by socket")
    ca.add_argument("--trace-sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                    default=[1 * MiB, 2 * MiB, 4 * MiB, 16 * MiB],
                    help="sizes of the traced jobs (default: 1MiB,2MiB,4MiB,16MiB)")
    ca.add_argument("--sweep", nargs="*", metavar="JSON",
                    help="also fit on the k x S cells of saved benchmarks/sweep.py results (other jobs' CPU: 0)")
    ca.add_argument("--sweep-clouds", nargs="*", metavar="SPEC",
                    help="only these clouds of the --sweep files (default: all even ones)")
    ca.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                    default=[1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 32 * MiB],
                    help="comma-separated (default: 1MiB,2MiB,4MiB,8MiB,32MiB: the small ones pin a ring step's wait)")
    ca.add_argument("--iters", type=int, default=3, help="timed allreduces per size and job (default: 3)")
    ca.add_argument("--rounds", type=int, default=3,
                    help="FastHorovod jobs per cloud (new connections each time; the median is fitted) (default: 3)")
    ca.add_argument("--threshold", type=parse_size, default=64 << 10,
                    help="FASTHOROVOD_PROXY_THRESHOLD_BYTES of the jobs (default: 64KiB, allreduce.py's)")
    ca.add_argument("--machine-cores", type=float, default=float(len(os.sched_getaffinity(0))),
                    help="cores the emulated hosts share (default: this process's)")
    ca.add_argument("--job-timeout", type=float, default=300, help="seconds per benchmark job (default: 300)")
    ca.add_argument("--prior", metavar="JSON", help="start from these parameters")
    ca.add_argument("--placement-model", metavar="JSON",
                    help="take kappa, eta, gamma from a benchmarks/placement.py result")
    ca.add_argument("--reuse", nargs="*", metavar="JSON", help="also fit on the observations of earlier calibrations")
    ca.add_argument("--skip-micro", action="store_true", help="do not measure the unit costs")
    ca.add_argument("--background-scale", type=float, default=1.0,
                    help="multiply the measured CPU of other jobs by this before fitting (0: ignore it; the "
                         "measurement counts ranks started over ssh as other jobs) (default: 1)")
    ca.set_defaults(func=cmd_calibrate)

    va = sub.add_parser("validate", help="measure runs the model was not fitted on and compare")
    va.add_argument("--model", required=True, metavar="JSON", help="a calibrate output")
    va.add_argument("--out", default="sim-validation.json")
    va.add_argument("--clouds", nargs="*", default=["6:1gbit:200mbit", "6:500mbit:100mbit"])
    va.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                    default=[4 * MiB, 16 * MiB, 64 * MiB], help="comma-separated (default: 4MiB,16MiB,64MiB)")
    va.add_argument("--iters", type=int, default=3)
    va.add_argument("--rounds", type=int, default=3,
                    help="FastHorovod jobs per cloud (new connections each time; the median is compared) (default: 3)")
    va.add_argument("--train-cloud", default="4:1gbit:200mbit", help="'' to skip the training validation")
    va.add_argument("--train-model", default="alexnet")
    va.add_argument("--steps", type=int, default=3, help="timed training steps (default: 3)")
    va.add_argument("--trace-root", help="keep the training traces here (default: a temporary directory)")
    va.add_argument("--job-timeout", type=float, default=400)
    va.add_argument("--saved-sweep", nargs="*", metavar="JSON",
                    help="also predict every k x S cell of saved benchmarks/sweep.py results (no jobs run)")
    va.add_argument("--saved-clouds", nargs="*", metavar="SPEC",
                    help="only these clouds of the --saved-sweep files (default: all even ones)")
    va.add_argument("--saved-background", type=float, default=0.0,
                    help="other jobs' CPU to assume for --saved-sweep (not recorded there) (default: 0)")
    va.set_defaults(func=cmd_validate)

    pj = sub.add_parser("project", help="tables (and plots) for 16-256 GPUs on AWS-like clusters")
    pj.add_argument("--model", metavar="JSON", help="a calibrate output (default: the built-in priors)")
    pj.add_argument("--validation", metavar="JSON", help="take the band from a validate output's largest error")
    pj.add_argument("--band", type=float, help="relative error band of communication times (default: from "
                                               "--validation, else 0.15)")
    pj.add_argument("--workloads", nargs="+", default=list(tr.WORKLOADS), choices=list(tr.WORKLOADS))
    pj.add_argument("--gpus", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    pj.add_argument("--nics", type=parse_rate, nargs="+", default=[25e9, 100e9])
    pj.add_argument("--per-flow", type=parse_rate, default=5e9)
    pj.add_argument("--cores", type=float, nargs="+", default=[48, 96])
    pj.add_argument("--rtt", type=parse_seconds, default=1e-4)
    pj.add_argument("--stage-rate", type=parse_rate, default=96e9,
                    help="GPU<->host copy rate in bit/s (default: 96gbit = 12 GB/s, PCIe 3.0 x16)")
    pj.add_argument("--goodput", type=float, default=0.97,
                    help="TCP goodput of a configured cloud rate, one flow's and a full link's (default: 0.97)")
    pj.add_argument("--keep-kappa-net", action="store_true",
                    help="keep the emulator's network-stack cost (default: 0 on a real NIC)")
    pj.add_argument("--keep-kappa-lane", action="store_true",
                    help="keep the emulator's CPU per byte on a lane's critical path (default: the proxy's own "
                         "per-byte cost kappa, measured on loopback: the emulator's also holds its network stack)")
    pj.add_argument("--keep-latency", action="store_true",
                    help="keep the calibrated t0, alpha and queue ahead of a frame (default: the priors, 2 ms, 0.2 ms "
                         "and none: the emulator's are its own scheduler's and shapers')")
    pj.add_argument("--compute-factor", type=float, default=1.0,
                    help="scale the published compute times (0.33: a GPU 3x faster)")
    pj.add_argument("--decode-rate", type=float, default=5e11,
                    help="bytes/s of fp32 CD-SGD decodes per rank (default 5e11: on the GPU)")
    pj.add_argument("--out", help="write the projection as JSON")
    pj.add_argument("--markdown", help="write the table as markdown")
    pj.add_argument("--plot", help="write a PNG (pip install 'fasthorovod[plot]')")
    pj.set_defaults(func=cmd_project)
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

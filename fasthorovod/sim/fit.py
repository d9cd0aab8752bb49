"""Fitting the model to measured allreduces, and its residuals.

* ``goodput``: the start-up probe's one-flow rate over the cloud's per-flow cap (median);
* ``link_goodput``: the raw-TCP ring ceiling (iperf3, enough flows to fill the link) over the link
  rate (median over the jobs that measured it);
* Horovod: T − fixed = t0_hvd + 2(n−1)·alpha_hvd + (2(n−1)/n · M / (goodput · C)) · (1 / hvd_eff),
  linear least squares in (t0_hvd, alpha_hvd, 1/hvd_eff), each clamped to its physical range;
* FastHorovod: for each (kappa_net, kappa_lane, link_jitter) on a grid (then downhill from the best
  point: Nelder-Mead if scipy is installed, and one coordinate at a time) the rates follow from the model, and T − M/R − fixed = t0_fh + 2(n−1)·alpha_fh by least
  squares; the pair with the smallest sum of squared *relative* errors wins.
Residuals are (predicted − measured) / measured per observation."""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Dict, List, Sequence

from fasthorovod.sim import model as m


def _lstsq(rows: Sequence[Sequence[float]], y: Sequence[float]) -> List[float]:
    import numpy as np

    a = np.asarray(rows, dtype=float)
    b = np.asarray(y, dtype=float)
    w = 1.0 / np.maximum(np.abs(b), 1e-6)  # relative errors: weight each row by 1/|measured|
    sol, *_ = np.linalg.lstsq(a * w[:, None], b * w, rcond=None)
    return [float(v) for v in sol]


def cluster_of(obs: Dict, cores: float) -> m.Cluster:
    return m.Cluster.emulated(obs["spec"], cores=cores, background_cores=obs.get("background_cores", 0.0))


def plane_of(obs: Dict, threshold: int) -> m.Plane:
    """The data plane an observation ran: its k and S, and the lane's striping of its date
    (``striping``: runs measured before commit 636c542 ran "first-free")."""
    return m.Plane(k=int(obs.get("k") or 4), S=int(obs.get("S") or 1), threshold=threshold,
                   striping=obs.get("striping") or "least-left")


def predict_obs(obs: Dict, p: m.Params, cores: float, threshold: int) -> float:
    c = cluster_of(obs, cores)
    if obs["backend"].startswith("horovod"):
        return m.horovod_allreduce(obs["bytes"], c, p)["seconds"]
    return m.fasthorovod_allreduce(obs["bytes"], c, plane_of(obs, threshold), p)["seconds"]


def residuals(observations: Sequence[Dict], p: m.Params, cores: float, threshold: int) -> List[Dict]:
    out = []
    for o in observations:
        pred = predict_obs(o, p, cores, threshold)
        c = cluster_of(o, cores)
        out.append({"spec": o["spec"], "backend": o["backend"], "bytes": o["bytes"],
                    "measured_s": o["seconds"], "predicted_s": pred,
                    "measured_busbw_gbps": m.busbw(o["bytes"], o["seconds"], c.ranks) * 8e-9,
                    "predicted_busbw_gbps": m.busbw(o["bytes"], pred, c.ranks) * 8e-9,
                    "error": (pred - o["seconds"]) / o["seconds"],
                    "background_cores": o.get("background_cores", 0.0)})
    return out


def fit(observations: Sequence[Dict], prior: m.Params, cores: float = 2.0, threshold: int = 64 << 10) -> m.Params:
    p = dataclasses.replace(prior, meta=dict(prior.meta))
    ones = [o["probe_one_flow_Bps"] / cluster_of(o, cores).flow_Bps for o in observations
            if o.get("probe_one_flow_Bps") and not o["backend"].startswith("horovod")]
    if ones:
        p.goodput = min(1.0, statistics.median(ones))
    hvd = [o for o in observations if o["backend"].startswith("horovod")]
    if len(hvd) >= 3:
        rows, y = [], []
        for o in hvd:
            c = cluster_of(o, cores)
            n = c.ranks
            fixed = c.rtt_s + m.stage_seconds(o["bytes"], c, p) + 2 * (n - 1) * c.rtt_s / 2
            rows.append([1.0, 2 * (n - 1), m.ring_bytes(o["bytes"], n) / (p.goodput * c.flow_Bps)])
            y.append(o["seconds"] - fixed)
        t0, alpha, inv_eff = _lstsq(rows, y)
        p.t0_hvd, p.alpha_hvd = max(0.0, t0), max(0.0, alpha)
        p.hvd_eff = min(1.0, max(0.05, 1.0 / inv_eff if inv_eff > 0 else 1.0))
    ceilings = [o["ceiling_Bps"] / cluster_of(o, cores).nic_Bps for o in observations if o.get("ceiling_Bps")]
    if ceilings:
        p.link_goodput = min(1.0, statistics.median(ceilings))
    fh = [o for o in observations if not o["backend"].startswith("horovod") and o["bytes"] >= threshold]
    if len(fh) >= 2:
        p = _fit_fasthorovod(fh, p, cores, threshold)
    return p


def _fh_at(fh, q: m.Params, cores: float, threshold: int):
    """(t0, alpha) by least squares at the CPU costs of q, and the sum of squared relative errors."""
    rows, y = [], []
    for o in fh:
        c = cluster_of(o, cores)
        n = c.ranks
        rate = m.fasthorovod_rate(c, plane_of(o, threshold), q, o["bytes"])["rate"]
        fixed = c.rtt_s + m.stage_seconds(o["bytes"], c, q) + 2 * (n - 1) * c.rtt_s / 2
        rows.append([1.0, 2 * (n - 1)])
        y.append(o["seconds"] - fixed - m.ring_bytes(o["bytes"], n) / rate)
    t0, alpha = _lstsq(rows, y)
    q = dataclasses.replace(q, t0_fh=max(0.0, t0), alpha_fh=max(0.0, alpha))
    err = sum(((predict_obs(o, q, cores, threshold) - o["seconds"]) / o["seconds"]) ** 2 for o in fh)
    return err, q


def _fit_fasthorovod(fh, p: m.Params, cores: float, threshold: int) -> m.Params:
    coarse = [0.0] + [1e-10 * (10 ** (i / 6)) for i in range(0, 16)]  # 0.1 .. 46 ns/B, 6 per decade
    jitters = [0.0, 0.1, 0.25]
    best = None
    for kn in coarse:
        for kl in coarse:
            for v in jitters:
                cand = _fh_at(fh, dataclasses.replace(p, kappa_net=kn, kappa_lane=kl, link_jitter=v), cores, threshold)
                if best is None or cand[0] < best[0]:
                    best = cand
    try:  # then downhill from the best grid point (log CPU costs, jitter), if scipy is there
        from scipy.optimize import minimize
    except ImportError:
        minimize = None
    if minimize is not None:
        q0 = best[1]

        def at(x):
            return dataclasses.replace(q0, kappa_net=math.exp(x[0]), kappa_lane=math.exp(x[1]),
                                       link_jitter=max(0.0, x[2]))

        x0 = [math.log(max(q0.kappa_net, 1e-11)), math.log(max(q0.kappa_lane, 1e-11)), q0.link_jitter]
        res = minimize(lambda x: _fh_at(fh, at(x), cores, threshold)[0], x0, method="Nelder-Mead",
                       options={"xatol": 1e-3, "fatol": 1e-9, "maxiter": 400})
        cand = _fh_at(fh, at(res.x), cores, threshold)
        if cand[0] < best[0]:
            best = cand
    for _ in range(2):  # finer: around the best, one coordinate at a time
        q = best[1]
        axis = lambda v: sorted({0.0} | {max(v, 1e-10) * 10 ** (j / 24) for j in range(-6, 7)})  # noqa: E731
        for name, values in (("kappa_net", axis(q.kappa_net)), ("kappa_lane", axis(q.kappa_lane)),
                             ("link_jitter", sorted({max(0.0, q.link_jitter + d) for d in
                                                     (-0.06, -0.04, -0.02, 0.0, 0.02, 0.04, 0.06)}))):
            for v in values:
                cand = _fh_at(fh, dataclasses.replace(best[1], **{name: v}), cores, threshold)
                if cand[0] < best[0]:
                    best = cand
    return best[1]


def summary(res: Sequence[Dict]) -> Dict:
    errs = [abs(r["error"]) for r in res]
    if not errs:
        return {"n": 0}
    return {"n": len(errs), "mean_abs": statistics.fmean(errs), "median_abs": statistics.median(errs),
            "max_abs": max(errs)}

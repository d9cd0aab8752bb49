"""Fitting the model to measured allreduces, and its residuals.

* ``goodput``: the start-up probe's one-flow rate over the cloud's per-flow cap (median);
* Horovod: T − fixed = t0_hvd + 2(n−1)·alpha_hvd + (2(n−1)/n · M / (goodput · C)) · (1 / hvd_eff),
  linear least squares in (t0_hvd, alpha_hvd, 1/hvd_eff), each clamped to its physical range;
* FastHorovod: for each kappa_net on a log grid the rates follow from the model, then
  T − M/R − fixed = t0_fh + 2(n−1)·alpha_fh by least squares; the kappa_net with the smallest
  sum of squared *relative* errors wins.
Residuals are (predicted − measured) / measured per observation."""
from __future__ import annotations

import dataclasses
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
    return m.Plane(k=int(obs.get("k") or 4), S=int(obs.get("S") or 1), threshold=threshold)


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
    fh = [o for o in observations if not o["backend"].startswith("horovod") and o["bytes"] >= threshold]
    if len(fh) >= 2:
        best = None
        grid = [0.0] + [1e-10 * (10 ** (i / 12)) for i in range(0, 37)]  # 0.1 ns/B .. 100 ns/B
        for kn in grid:
            q = dataclasses.replace(p, kappa_net=kn)
            rows, y = [], []
            for o in fh:
                c = cluster_of(o, cores)
                n = c.ranks
                rate = m.fasthorovod_rate(c, plane_of(o, threshold), q)["rate"]
                fixed = c.rtt_s + m.stage_seconds(o["bytes"], c, q) + 2 * (n - 1) * c.rtt_s / 2
                rows.append([1.0, 2 * (n - 1)])
                y.append(o["seconds"] - fixed - m.ring_bytes(o["bytes"], n) / rate)
            t0, alpha = _lstsq(rows, y) if len(fh) >= 2 else (q.t0_fh, q.alpha_fh)
            q.t0_fh, q.alpha_fh = max(0.0, t0), max(0.0, alpha)
            err = sum(((predict_obs(o, q, cores, threshold) - o["seconds"]) / o["seconds"]) ** 2 for o in fh)
            if best is None or err < best[0]:
                best = (err, q)
        p = best[1]
    return p


def summary(res: Sequence[Dict]) -> Dict:
    errs = [abs(r["error"]) for r in res]
    if not errs:
        return {"n": 0}
    return {"n": len(errs), "mean_abs": statistics.fmean(errs), "median_abs": statistics.median(errs),
            "max_abs": max(errs)}

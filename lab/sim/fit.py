"""Fitting the model to measured allreduces, and its residuals.

* ``goodput``: the start-up probe's one-flow rate over the cloud's per-flow cap (median);
* ``link_goodput``: the raw-TCP ring ceiling (iperf3, enough flows to fill the link) over the link
  rate (median over the jobs that measured it);
* Horovod: T = fixed + t0_hvd + the ring as two chains of Gloo segments (model.horovod_pipeline)
  waiting alpha_hvd between frames, at hvd_eff · goodput · C; (hvd_eff, alpha_hvd) on a grid then
  downhill, t0_hvd by least squares at each, each clamped to its physical range;
* FastHorovod: for each (kappa_net, kappa_lane, link_jitter) on a grid (then downhill from the best
  point: Nelder-Mead if scipy is installed, and one coordinate at a time) the rates and the rings'
  chains follow from the model; alpha_fh (the wait of a chain between its frames) by a search on one
  axis and t0_fh by least squares at each; the smallest sum of squared *relative* errors wins.
Since the rings are chains whose waits overlap other chains' bytes (2026-12-02 evening), the time is
not linear in alpha: hence the searches where there were linear least squares.
Residuals are (predicted − measured) / measured per observation."""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Dict, List, Optional, Sequence

from lab.sim import model as m


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
        if not o["backend"].startswith("horovod"):
            plane = plane_of(o, threshold)
            out[-1].update(k=plane.k, S=plane.S, rounds=o.get("rounds", 1))
    return out


def fit(observations: Sequence[Dict], prior: m.Params, cores: float = 2.0, threshold: int = 64 << 10,
        alpha_fh: Optional[float] = None) -> m.Params:
    """The parameters that fit `observations`; `alpha_fh`: FastHorovod's mean wait of a chain between
    two frames as measured (:func:`trace_wait`) rather than fitted."""
    p = dataclasses.replace(prior, meta=dict(prior.meta))
    ones = [o["probe_one_flow_Bps"] / cluster_of(o, cores).flow_Bps for o in observations
            if o.get("probe_one_flow_Bps") and not o["backend"].startswith("horovod")]
    if ones:
        p.goodput = min(1.0, statistics.median(ones))
    hvd = [o for o in observations if o["backend"].startswith("horovod")]
    if len(hvd) >= 3:
        p = _fit_horovod(hvd, p, cores)
    ceilings = [o["ceiling_Bps"] / cluster_of(o, cores).nic_Bps for o in observations if o.get("ceiling_Bps")]
    if ceilings:
        p.link_goodput = min(1.0, statistics.median(ceilings))
    fh = [o for o in observations if not o["backend"].startswith("horovod") and o["bytes"] >= threshold]
    if len(fh) >= 2:
        p = _fit_fasthorovod(fh, p, cores, threshold, alpha_fh)
    return p


def _best_t0(base: Sequence[float], measured: Sequence[float]) -> float:
    """t0 ≥ 0 minimising Σ ((t0 + base_i − y_i) / y_i)²."""
    w = [1.0 / (y * y) for y in measured]
    return max(0.0, sum((y - b) * wi for b, y, wi in zip(base, measured, w)) / sum(w))


def _golden(f, lo: float, hi: float, iters: int = 40) -> float:
    """The minimum of a unimodal f on [lo, hi] (golden section), or an end if that is lower."""
    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    x = (a + b) / 2.0
    return min((x, lo, hi), key=f)


ALPHA_MAX = 0.05  # s: the search range of a ring step's wait


def _latency_fit(plans, measured: Sequence[float], ring=m.pipeline_seconds, iters: int = 40):
    """(sum of squared relative errors, t0, alpha) for observations whose times are
    fixed_i + t0 + ring(pipe_i, alpha + extra_i): alpha by a search, t0 at each. `ring`: the closed
    network's steady state (fast: the search over the CPU costs) or the ring from its common start
    (:func:`model.ring_seconds`: the final fit of the latency)."""
    def at(alpha: float):
        base = [fixed + ring(pipe, alpha + extra) for fixed, pipe, extra in plans]
        t0 = _best_t0(base, measured)
        err = sum(((t0 + b - y) / y) ** 2 for b, y in zip(base, measured))
        return err, t0

    alpha = _golden(lambda a: at(a)[0], 0.0, ALPHA_MAX, iters)
    err, t0 = at(alpha)
    return err, t0, alpha


def _fit_horovod(hvd, p: m.Params, cores: float) -> m.Params:
    measured = [o["seconds"] for o in hvd]

    def at(eff: float):
        q = dataclasses.replace(p, hvd_eff=eff)
        plans = []
        for o in hvd:
            c = cluster_of(o, cores)
            rate = m.horovod_rate(c, q)["rate"]
            plans.append((c.rtt_s + m.stage_seconds(o["bytes"], c, q), m.horovod_pipeline(o["bytes"], c, q, rate),
                          m.step_latency(c, 0.0)))
        err, t0, alpha = _latency_fit(plans, measured)
        return err, dataclasses.replace(q, t0_hvd=t0, alpha_hvd=alpha)

    best = min((at(0.05 + 0.95 * i / 38) for i in range(39)), key=lambda x: x[0])
    eff = best[1].hvd_eff
    for step in (0.0125, 0.003, 0.0008):  # then finer around the best share of one flow
        for d in (-2, -1, 1, 2):
            cand = at(min(1.0, max(0.05, eff + d * step)))
            if cand[0] < best[0]:
                best = cand
        eff = best[1].hvd_eff
    return best[1]


# Mean waits (s) at which the cost of the waits of each observation's ring is computed once (from its
# common start, model.ring_seconds) and then interpolated: the search over the CPU costs moves the
# rates, and with them the bytes' time, but barely the cost the waits add to it.
ALPHA_GRID = (0.0, 1e-4, 2e-4, 3.5e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 2.5e-3, 3e-3, 4e-3, 5e-3, 6e-3, 8e-3,
              1e-2, 1.3e-2, 1.6e-2, 2e-2, 2.5e-2, 3e-2, 4e-2, 5e-2)


def _plans(fh, q: m.Params, cores: float, threshold: int):
    """Per observation: its fixed time, its ring as a function of the mean wait, the ring's bytes alone
    (at q's rates) and what the model adds to alpha (RTT/2, and the queue term of the exogenous form)."""
    plans = []
    for o in fh:
        c = cluster_of(o, cores)
        plane = plane_of(o, threshold)
        rate = m.fasthorovod_rate(c, plane, q, o["bytes"])["rate"]
        fixed = c.rtt_s + m.stage_seconds(o["bytes"], c, q) + m.local_phase_seconds(o["bytes"], c, plane, q)
        extra = m.chain_wait(c, plane, dataclasses.replace(q, alpha_fh=0.0), o["bytes"])
        ring = (lambda w, c=c, plane=plane, o=o, rate=rate:
                m.fasthorovod_ring_seconds(c, plane, q, o["bytes"], rate, w))
        plans.append((fixed, ring, m.ring_seconds(m.fasthorovod_pipeline(c, plane, q, o["bytes"], rate), 0.0), extra))
    return plans


def _wait_costs(plans, alphas):
    """Per observation, what its ring adds to its bytes alone at each mean wait of `alphas`."""
    return [[ring(a + extra) - bytes_s for a in alphas] for _, ring, bytes_s, extra in plans]


def _interp(costs, alpha: float, grid=ALPHA_GRID) -> float:
    import bisect

    if len(costs) == 1:
        return costs[0]
    i = min(max(bisect.bisect_right(grid, alpha) - 1, 0), len(grid) - 2)
    a0, a1 = grid[i], grid[i + 1]
    return costs[i] + (costs[i + 1] - costs[i]) * (alpha - a0) / (a1 - a0)


def _fh_at(fh, q: m.Params, cores: float, threshold: int, costs=None, alpha=None):
    """(sum of squared relative errors, q with t0 and alpha) at the CPU costs of q: alpha by a search
    (or `alpha` as given), t0 by least squares at each. The rings as the model predicts them
    (model.fasthorovod_ring_seconds): exactly, or (`costs`, from :func:`_wait_costs`) as the bytes at
    q's rates plus the waits' cost interpolated."""
    plans = _plans(fh, q, cores, threshold)
    measured = [o["seconds"] for o in fh]
    if costs is None:
        ring = [lambda a, f=f, extra=extra: f(a + extra) for _, f, _, extra in plans]
    else:
        ring = [lambda a, b=b, c=c: b + _interp(c, a) for (_, _, b, _), c in zip(plans, costs)]

    def at(a: float):
        base = [fixed + f(a) for (fixed, _, _, _), f in zip(plans, ring)]
        t0 = _best_t0(base, measured)
        return sum(((t0 + b - y) / y) ** 2 for b, y in zip(base, measured)), t0

    if alpha is None:
        alpha = _golden(lambda a: at(a)[0], 0.0, ALPHA_MAX, 40 if costs is not None else 28)
    err, t0 = at(alpha)
    return err, dataclasses.replace(q, t0_fh=t0, alpha_fh=alpha)


def _fit_fasthorovod(fh, p: m.Params, cores: float, threshold: int, alpha: Optional[float] = None) -> m.Params:
    """The CPU costs and the link jitter on a grid, then downhill; at each, alpha (unless given: measured
    from frame traces) and t0. The waits' cost per observation is computed at the prior's rates, and
    once more at the best point's, before the last, exact fit of t0 (and alpha)."""
    best = None
    alphas = ALPHA_GRID if alpha is None else (alpha,)
    for _ in range(2):
        costs = _wait_costs(_plans(fh, best[1] if best else p, cores, threshold), alphas)
        best = _search_cpu(fh, best[1] if best else p, cores, threshold, costs, alpha)
    return _fh_at(fh, best[1], cores, threshold, alpha=alpha)[1]


def _search_cpu(fh, p: m.Params, cores: float, threshold: int, costs, alpha):
    coarse = [0.0] + [1e-10 * (10 ** (i / 6)) for i in range(0, 16)]  # 0.1 .. 46 ns/B, 6 per decade
    jitters = [0.0, 0.1, 0.25]
    best = None
    for kn in coarse:
        for kl in coarse:
            for v in jitters:
                cand = _fh_at(fh, dataclasses.replace(p, kappa_net=kn, kappa_lane=kl, link_jitter=v), cores, threshold,
                              costs, alpha)
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
        res = minimize(lambda x: _fh_at(fh, at(x), cores, threshold, costs, alpha)[0], x0, method="Nelder-Mead",
                       options={"xatol": 1e-3, "fatol": 1e-9, "maxiter": 400})
        cand = _fh_at(fh, at(res.x), cores, threshold, costs, alpha)
        if cand[0] < best[0]:
            best = cand
    for _ in range(2):  # finer: around the best, one coordinate at a time
        q = best[1]
        axis = lambda v: sorted({0.0} | {max(v, 1e-10) * 10 ** (j / 24) for j in range(-6, 7)})  # noqa: E731
        for name, values in (("kappa_net", axis(q.kappa_net)), ("kappa_lane", axis(q.kappa_lane)),
                             ("link_jitter", sorted({max(0.0, q.link_jitter + d) for d in
                                                     (-0.06, -0.04, -0.02, 0.0, 0.02, 0.04, 0.06)}))):
            for v in values:
                cand = _fh_at(fh, dataclasses.replace(best[1], **{name: v}), cores, threshold, costs, alpha)
                if cand[0] < best[0]:
                    best = cand
    return best


def summary(res: Sequence[Dict]) -> Dict:
    errs = [abs(r["error"]) for r in res]
    if not errs:
        return {"n": 0}
    return {"n": len(errs), "mean_abs": statistics.fmean(errs), "median_abs": statistics.median(errs),
            "max_abs": max(errs)}

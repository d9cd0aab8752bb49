"""Where the proxies run, and how many: a CPU placement model (SCP adapted) and a planner.

A proxy is one thread of CPU work per lane: for every byte it sends to its ring successor it also
receives one byte from its predecessor and, in the reduce-scatter half, adds half a byte into the
shard (send/recv syscalls with the kernel's copies, the float adds, the loopback or NIC path). So
its cost is a number of CPU-seconds per *wire byte* it sends, **kappa**, the same for any ring
size (per wire byte: one byte sent, one received, half a byte reduced). A lane's ring cannot keep
its proxy busy all the time even on an idle CPU: the proxy waits for its predecessor's segments,
so a proxy alone is busy at most a fraction **eta** of the time, and carries at most eta / kappa
bytes per second.

The model follows SCP ("separated and clustered performance predictor",
lab/placement.md): a thread runs *separated* when nothing else busy shares its logical CPU and
its SMT siblings are idle, and *clustered* otherwise. Clustering costs twice:

* **time**: threads on one logical CPU share it. The kernel's fair scheduler gives runnable threads
  equal CPU time, so the CPU time each thread gets is the max-min fair share of every CPU set its
  affinity allows (a proxy never asks for more than eta, a compute thread for more than its duty
  cycle; unpinned threads may use any usable CPU, so a set of CPUs is shared by every thread
  whose affinity lies inside it). A lane runs at its slowest proxy's pace, so the fair sharing is
  over lanes: each lane's rate rises until a CPU set it uses is full (progressive filling).
* **cost per byte**: a clustered thread's per-byte cost rises (context switches, caches shared
  with another working set; an SMT sibling's execution units):

      kappa_p = kappa * (1 + gamma * (c_p - b_p) + gamma_busy * b_p + beta * o_p - delta * s_p * c_p)

  where c_p = min(1, m_p - 1) is the fraction of p's time that its logical CPU is shared (m_p >= 1:
  how many busy threads that CPU holds on average, every thread's demand spread over its allowed
  CPUs as evenly as the scheduler can; SCP's clustered state, paid once: a third co-runner
  pollutes a cache no further), b_p the part of c_p due to busy threads that are not proxies (a
  compute thread's small working set costs less, gamma_busy), o_p in [0, 1] how busy p's SMT
  siblings are, and s_p in [0, 1] how much of the time p's ring neighbour of the same lane shares
  its CPU. **Ring neighbours hand the CPU over**: one runs while the other waits for its bytes, so
  a neighbour on p's CPU is not counted in m_p (a pair alone on a CPU is not clustered) and time
  is still shared as two threads; when a third thread also wants the CPU, the pair's hand-overs
  are cheaper per byte, delta (the woken neighbour waits its turn and finds more bytes; measured
  on the loopback rig, where the proxies' own CPU per byte fell from 0.53 to 0.38 ns with a compute
  thread on the pair's CPU). s_p only exists on a test rig whose ranks share a host (a loopback
  ring); on a real cluster a host runs one proxy per lane, s_p = 0.
* **the scheduler's states** (``_states``): an unpinned proxy runs in bursts and sleeps on its ring
  neighbour, so the kernel places it anew at each wake-up; but the load balancer does not leave a
  runnable thread queued while a CPU it may use is idle or less loaded. The states are the
  assignments of the unpinned proxies that the balancer leaves alone, equally likely. A
  duty-cycled busy thread is runnable a fraction d of the time and then competes like any busy
  thread. The prediction is the time average over these states, each predicted as a pinning.

The parameters are physical and few: kappa (s/B), eta, gamma, gamma_busy, beta, delta.
``PlacementModel.fit`` takes them from measured placements (benchmarks/placement.py). The multipliers
are what they say, changes of CPU-seconds per byte, so when the proxies' own CPU time per byte was
measured they come from a linear least-squares fit of it (this survives a host shared with other
jobs far better than rates do); for fixed multipliers and eta every predicted rate is proportional
to 1/kappa, so kappa has a closed-form least-squares solution on log rates, and eta is a
one-dimensional search. Without CPU measurements (eta, gamma) are searched on a grid together. beta can only be
measured on a host with SMT siblings (or CPUs described as such: ``fit(fit_beta=True)``, as the
harness does for a VM's vCPUs); elsewhere it keeps a stated prior (``beta_measured`` says which). ``components`` keeps the measured unit costs the workload is made of (reduction, memcpy,
loopback send+recv per byte), for the bottom-up check kappa ~ socket + reduce / 2.

``plan`` chooses k and a pinning: given the usable CPUs (``read_topology``), how many CPUs the
training compute wants and the rate the network could carry, it predicts every candidate (no
pinning; k proxies on d dedicated CPUs, separate physical cores first, the compute pinned to the
rest) and takes the fewest proxies and CPUs within 5% of the best rate that leave the compute its
CPUs; it never adds a proxy that does not help, and a network-bound job gets one.

Everything here is pure Python and needs no processes (tests/unit/test_placement.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import time
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import psutil

CpuSet = Tuple[int, ...]

# -- topology ---------------------------------------------------------------------------------------


def parse_cpu_list(text: str) -> List[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: List[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            step = 1
            if ":" in hi:  # 0-7:2 (stride), accepted by the kernel's parser
                hi, s = hi.split(":", 1)
                step = int(s.split("/")[0])
            cpus.extend(range(int(lo), int(hi) + 1, step))
        else:
            cpus.append(int(part))
    return sorted(set(cpus))


@dataclasses.dataclass(frozen=True)
class Topology:
    """The logical CPUs this process may use and how they group into physical cores and NUMA nodes."""

    cpus: CpuSet
    core_of: Mapping[int, CpuSet]  # cpu -> the usable CPUs of its physical core (itself included)
    node_of: Mapping[int, int]  # cpu -> NUMA node (0 where the host shows none)

    def siblings(self, cpu: int) -> CpuSet:
        """The other usable CPUs of `cpu`'s physical core (its SMT siblings)."""
        return tuple(c for c in self.core_of.get(cpu, (cpu,)) if c != cpu)

    @property
    def smt(self) -> bool:
        return any(len(v) > 1 for v in self.core_of.values())

    def cores(self) -> List[CpuSet]:
        """Physical cores (as tuples of usable CPUs), in CPU order."""
        seen, out = set(), []
        for cpu in self.cpus:
            core = self.core_of.get(cpu, (cpu,))
            if core not in seen:
                seen.add(core)
                out.append(core)
        return out

    def describe(self) -> str:
        nodes = sorted(set(self.node_of.get(c, 0) for c in self.cpus))
        return (f"{len(self.cpus)} usable CPUs {list(self.cpus)}, {len(self.cores())} physical cores"
                f"{' (SMT)' if self.smt else ' (no SMT siblings)'}, NUMA nodes {nodes}")


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def read_topology(sysfs: str = "/sys/devices/system", usable: Optional[Iterable[int]] = None) -> Topology:
    """Usable CPUs (``os.sched_getaffinity(0)`` unless given), their SMT siblings from
    ``cpu/cpuN/topology/core_cpus_list`` (or the older ``thread_siblings_list``) and NUMA nodes from
    ``node/nodeM/cpulist``. Missing files mean: no siblings, node 0."""
    cpus = tuple(sorted(set(usable if usable is not None else os.sched_getaffinity(0))))
    usable_set = set(cpus)
    core_of: Dict[int, CpuSet] = {}
    for cpu in cpus:
        text = None
        for name in ("core_cpus_list", "thread_siblings_list"):
            text = _read(os.path.join(sysfs, "cpu", f"cpu{cpu}", "topology", name))
            if text is not None:
                break
        core = [c for c in parse_cpu_list(text) if c in usable_set] if text else []
        core_of[cpu] = tuple(sorted(set(core) | {cpu}))
    node_of: Dict[int, int] = {}
    node_dir = os.path.join(sysfs, "node")
    try:
        entries = os.listdir(node_dir)
    except OSError:
        entries = []
    for entry in entries:
        if entry.startswith("node") and entry[4:].isdigit():
            text = _read(os.path.join(node_dir, entry, "cpulist"))
            for cpu in parse_cpu_list(text or ""):
                if cpu in usable_set:
                    node_of[cpu] = int(entry[4:])
    for cpu in cpus:
        node_of.setdefault(cpu, 0)
    return Topology(cpus, core_of, node_of)


# -- placements -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProxySpec:
    """One proxy process: the lane it serves and the CPUs it may run on (None: any usable CPU)."""

    lane: int
    cpus: Optional[CpuSet] = None


@dataclasses.dataclass(frozen=True)
class Busy:
    """A busy thread that is not a proxy (training compute, the worker, another job): the CPUs it may
    run on (None: any usable CPU) and the fraction of the time it wants to run."""

    cpus: Optional[CpuSet] = None
    duty: float = 1.0


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which proxies and busy threads share which CPUs. A lane may have several local proxies (a
    loopback ring of local ranks); they run at one pace. ``lane_rate`` caps each lane and
    ``net_rate`` the sum over lanes (wire bytes/s the network carries; None: no cap)."""

    cpus: CpuSet
    proxies: Tuple[ProxySpec, ...]
    busy: Tuple[Busy, ...] = ()
    siblings: Mapping[int, CpuSet] = dataclasses.field(default_factory=dict)
    lane_rate: Optional[float] = None
    net_rate: Optional[float] = None
    reserved: Mapping[int, float] = dataclasses.field(default_factory=dict)
    """CPU-seconds per second of each CPU taken by threads outside the model (another job, measured
    after the fact); the modelled threads share what is left."""

    def lanes(self) -> List[int]:
        return sorted(set(p.lane for p in self.proxies))

    def to_json(self) -> dict:
        return {"cpus": list(self.cpus),
                "proxies": [{"lane": p.lane, "cpus": None if p.cpus is None else list(p.cpus)} for p in self.proxies],
                "busy": [{"cpus": None if b.cpus is None else list(b.cpus), "duty": b.duty} for b in self.busy],
                "siblings": {str(k): list(v) for k, v in self.siblings.items()},
                "lane_rate": self.lane_rate, "net_rate": self.net_rate,
                "reserved": {str(k): v for k, v in self.reserved.items()}}

    @classmethod
    def from_json(cls, d: Mapping) -> "Placement":
        opt = lambda v: None if v is None else tuple(v)  # noqa: E731
        return cls(tuple(d["cpus"]), tuple(ProxySpec(p["lane"], opt(p["cpus"])) for p in d["proxies"]),
                   tuple(Busy(opt(b["cpus"]), b.get("duty", 1.0)) for b in d.get("busy", ())),
                   {int(k): tuple(v) for k, v in d.get("siblings", {}).items()},
                   d.get("lane_rate"), d.get("net_rate"),
                   {int(k): float(v) for k, v in d.get("reserved", {}).items()})


@dataclasses.dataclass
class Prediction:
    """Rates in wire bytes/s. ``aggregate`` = sum of lane rates (what a collective gets once the
    lanes' shares follow their rates, the default rebalancing); ``equal_split`` = k * slowest lane
    (equal shards). ``proxy_cpu``/``busy_cpu``: CPU-seconds per second each one gets."""

    lane_rates: Dict[int, float]
    proxy_rates: List[float]
    proxy_cpu: List[float]
    busy_cpu: List[float]
    proxy_kappa: List[float]
    aggregate: float
    equal_split: float
    proxy_crowding: List[float] = dataclasses.field(default_factory=list)  # m_p
    proxy_sibling: List[float] = dataclasses.field(default_factory=list)  # o_p
    proxy_peer: List[float] = dataclasses.field(default_factory=list)  # s_p
    proxy_clustered: List[float] = dataclasses.field(default_factory=list)  # c_p = min(1, m_p - 1)
    proxy_clustered_busy: List[float] = dataclasses.field(default_factory=list)  # the part of c_p due to busy threads
    proxy_peer_clustered: List[float] = dataclasses.field(default_factory=list)  # s_p * c_p
    states: int = 1
    """How many scheduler states (where unpinned proxies sit, whether duty-cycled threads run) the
    prediction averages over."""


# -- the model --------------------------------------------------------------------------------------


def _first_root(loads: Sequence[Tuple[float, float]], fixed: float, capacity: float, lo: float) -> Optional[float]:
    """Smallest lam >= lo with fixed + sum(r * min(lam, c)) >= capacity, or None (never, up to the
    caps). Each term is linear up to its cap c, flat after."""
    total = fixed + sum(r * min(lo, c) for r, c in loads)
    if total >= capacity - 1e-12:
        return lo
    breaks = sorted(set(c for _, c in loads if c > lo))
    prev = lo
    for b in breaks + [math.inf]:
        slope = sum(r for r, c in loads if c > prev)
        if slope <= 0:
            if b == math.inf:
                return None
            prev = b
            continue
        at_b = total + slope * (b - prev) if b != math.inf else math.inf
        if at_b >= capacity - 1e-12:
            return prev + (capacity - total) / slope
        total, prev = at_b, b
    return None


@dataclasses.dataclass
class PlacementModel:
    kappa: float = 1.0e-9
    """CPU-seconds per wire byte of one proxy, separated (alone on an idle CPU)."""
    eta: float = 0.8
    """Largest fraction of the time a proxy is busy (the rest it waits on its ring neighbours)."""
    gamma: float = 0.0
    """Extra per-byte cost when the proxy's logical CPU is shared (SCP's "clustered"): times the
    fraction c_p = min(1, m_p - 1) of its time that another busy thread wants that CPU."""
    gamma_busy: Optional[float] = None
    """The same when the co-runner is a busy thread that is not a proxy (compute: a small working set
    pollutes the proxy's caches less than another proxy's stream); None: as gamma."""
    beta: float = 0.3
    """Extra per-byte cost when the proxy's SMT siblings are busy (a prior unless beta_measured)."""
    beta_measured: bool = False
    delta: float = 0.0
    """Per-byte saving of ring neighbours that share a CPU while a third thread also wants it (their
    hand-overs batch; times s_p * c_p; loopback rigs only)."""
    components: Dict[str, float] = dataclasses.field(default_factory=dict)
    """Measured unit costs, CPU-seconds per byte: reduce (float32 add), copy (memcpy), socket
    (loopback TCP send + receive of one byte, the CPU time charged to the two threads)."""
    fit_info: Dict = dataclasses.field(default_factory=dict)

    # -- serialization --

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping) -> "PlacementModel":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

    @classmethod
    def load(cls, path: str) -> "PlacementModel":
        with open(path) as f:
            return cls.from_json(json.load(f))

    def alone_rate(self) -> float:
        """Wire bytes/s of one proxy separated on an idle CPU (its ring's pace, eta / kappa)."""
        return self.eta / self.kappa

    def bottom_up_kappa(self) -> Optional[float]:
        """The CPU time a proxy's threads are charged per wire byte, from the unit costs: one byte
        sent and one received, plus half a byte reduced (no softirq, no ring bookkeeping; compare
        with the proxies' measured process CPU per byte)."""
        c = self.components
        if "socket" in c and "reduce" in c:
            return c["socket"] + 0.5 * c["reduce"]
        return None

    # -- prediction --

    def predict(self, placement: Placement) -> Prediction:
        return _predict(placement, self.kappa, self.eta, self.gamma, self.beta, self.delta, self.gamma_busy)

    # -- fitting --

    @classmethod
    def fit(cls, samples: Sequence[Tuple[Placement, Mapping[int, float]]], *,
            cpu_samples: Optional[Sequence[Tuple[Placement, Sequence[float]]]] = None, beta: float = 0.3,
            beta_measured: bool = False, fit_beta: bool = False, delta: float = 0.0,
            components: Optional[Mapping[str, float]] = None,
            eta_range: Tuple[float, float] = (0.2, 1.0), gamma_range: Tuple[float, float] = (0.0, 1.5)
            ) -> "PlacementModel":
        """Least squares on log lane rates: `samples` are (placement, {lane: measured wire bytes/s}).
        With `cpu_samples` (placement, each proxy's measured CPU-seconds per byte, in the
        placement's order) gamma and delta (and beta, with `fit_beta`) come from a linear fit of
        those, alternating with a
        search of eta; without, (eta, gamma) come from a grid refined twice around its best point
        and delta stays as given. kappa is closed-form in both (rates scale as 1/kappa)."""
        obs = [(pl, lane, rate) for pl, rates in samples for lane, rate in rates.items() if rate > 0]
        if not obs:
            raise ValueError("fit needs at least one positive measured rate")
        if any(pl.lane_rate is not None or pl.net_rate is not None for pl, _, _ in obs):
            raise ValueError("fit on CPU-bound placements (no lane_rate / net_rate caps)")
        placements = list({id(pl): pl for pl, _, _ in obs}.values())

        def sse(eta: float, gamma: float, dlt: float) -> Tuple[float, float]:
            unit = {id(pl): _predict(pl, 1.0, eta, gamma, beta, dlt, gamma_busy).lane_rates for pl in placements}
            logs = [math.log(unit[id(pl)][lane]) - math.log(rate) for pl, lane, rate in obs]
            log_kappa = sum(logs) / len(logs)
            return sum((x - log_kappa) ** 2 for x in logs), math.exp(log_kappa)

        def search_eta(gamma: float, dlt: float, lo: float, hi: float):
            best = None
            for _ in range(3):
                for i in range(17):
                    eta = lo + (hi - lo) * i / 16
                    err, kappa = sse(eta, gamma, dlt)
                    if best is None or err < best[0] - 1e-15:
                        best = (err, eta, kappa)
                step = (hi - lo) / 8
                lo, hi = max(eta_range[0], best[1] - step), min(eta_range[1], best[1] + step)
            return best

        info: Dict = {}
        gamma_busy: Optional[float] = None
        if cpu_samples:
            eta, gamma = 0.7, 0.0
            for _ in range(3):
                gamma, gamma_busy, beta, delta, cpu_fit = _fit_multipliers(cpu_samples, eta, beta, fit_beta)
                gamma = min(max(gamma, gamma_range[0]), gamma_range[1])
                if gamma_busy is not None:
                    gamma_busy = min(gamma_busy, gamma_range[1])
                err, eta, kappa = search_eta(gamma, delta, *eta_range)
            info.update(cpu_fit)
        else:
            best = None
            e_lo, e_hi = eta_range
            g_lo, g_hi = gamma_range
            steps = 16
            for _ in range(3):
                for i in range(steps + 1):
                    for j in range(steps + 1):
                        eta = e_lo + (e_hi - e_lo) * i / steps
                        gamma = g_lo + (g_hi - g_lo) * j / steps
                        err, kappa = sse(eta, gamma, delta)
                        if best is None or err < best[0] - 1e-15:
                            best = (err, eta, gamma, kappa)
                _, eta, gamma, _ = best
                de, dg = (e_hi - e_lo) / steps * 2, (g_hi - g_lo) / steps * 2
                e_lo, e_hi = max(eta_range[0], eta - de), min(eta_range[1], eta + de)
                g_lo, g_hi = max(gamma_range[0], gamma - dg), min(gamma_range[1], gamma + dg)
            err, eta, gamma, kappa = best
        info.update({"observations": len(obs), "placements": len(placements),
                     "rms_log_error": math.sqrt(err / len(obs))})
        return cls(kappa=kappa, eta=eta, gamma=gamma, gamma_busy=gamma_busy, beta=beta, beta_measured=beta_measured or fit_beta, delta=delta,
                   components=dict(components or {}), fit_info=info)


def _solve(a: List[List[float]], b: List[float]) -> Optional[List[float]]:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12 * max(1.0, max(abs(x) for row in m for x in row[:n])):
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _fit_multipliers(cpu_samples: Sequence[Tuple[Placement, Sequence[float]]], eta: float, beta: float,
                     fit_beta: bool = False) -> Tuple[float, Optional[float], float, float, Dict]:
    """The multipliers from measured CPU-seconds per byte y_p = c0 * (1 + gamma*(c_p - b_p)
    + gamma_busy*b_p + beta*o_p - delta*s_p*c_p) (b_p: the part of c_p due to busy non-proxy threads):
    linear least squares in (c0, c0*gamma, c0*gamma_busy, c0*beta, c0*delta), beta only when
    `fit_beta` (otherwise it stays as given). A regressor that never varies is left out: its
    multiplier is 0 (gamma_busy: None, as gamma; beta: as given). Returns (gamma, gamma_busy, beta,
    delta, info)."""
    rows, ys = [], []
    for pl, per_proxy in cpu_samples:
        pred = _predict(pl, 1.0, eta, 0.0, 0.0, 0.0)
        for i, y in enumerate(per_proxy):
            if y and y > 0:
                o, b = pred.proxy_sibling[i], pred.proxy_clustered_busy[i]
                rows.append([1.0 if fit_beta else 1.0 + beta * o, pred.proxy_clustered[i] - b, b, o,
                             -pred.proxy_peer_clustered[i]])
                ys.append(y)
    if not rows:
        raise ValueError("cpu_samples hold no positive CPU-per-byte measurement")
    candidates = (1, 2, 3, 4) if fit_beta else (1, 2, 4)
    used = [0] + [j for j in candidates if max(r[j] for r in rows) - min(r[j] for r in rows) > 1e-9]
    ata = [[sum(r[a] * r[b] for r in rows) for b in used] for a in used]
    aty = [sum(r[a] * y for r, y in zip(rows, ys)) for a in used]
    coef = _solve(ata, aty) or [sum(ys) / len(ys)] + [0.0] * (len(used) - 1)
    full = dict(zip(used, coef))
    c0 = full[0]
    ratio = {j: (full[j] / c0 if c0 > 0 else 0.0) for j in full}
    gamma = ratio.get(1, 0.0)
    gamma_busy = max(0.0, ratio[2]) if 2 in ratio else None
    if fit_beta:
        beta = max(0.0, ratio.get(3, 0.0))
    delta = ratio.get(4, 0.0)
    resid = [y - sum(full.get(j, 0.0) * r[j] for j in range(5)) for r, y in zip(rows, ys)]
    return gamma, gamma_busy, beta, min(max(delta, 0.0), 0.9), {
        "cpu_per_byte_alone": c0, "cpu_fit_points": len(ys),
        "cpu_fit_rms_relative": math.sqrt(sum((e / y) ** 2 for e, y in zip(resid, ys)) / len(ys))}


def _balanced_loads(universe: CpuSet, entities: Sequence[Tuple[CpuSet, float]], rounds: int = 30,
                    base: Optional[Mapping[int, float]] = None) -> Tuple[Dict[int, float], List[Dict[int, float]]]:
    """Each logical CPU's demand (busy threads on it, on average) when every thread's demand is
    spread over its allowed CPUs as evenly as the others allow (the scheduler's load balancing, as
    a fluid): repeatedly water-fill each thread's demand onto the least loaded of its CPUs.
    Returns the per-CPU loads and each thread's split {cpu: demand}."""
    load = {c: float((base or {}).get(c, 0.0)) for c in universe}
    spread: List[Dict[int, float]] = []
    for a, d in entities:
        share = {c: d / len(a) for c in a}
        spread.append(share)
        for c, x in share.items():
            load[c] += x
    for _ in range(rounds):
        for idx, (a, d) in enumerate(entities):
            if len(a) < 2 or d <= 0:
                continue
            for c, x in spread[idx].items():
                load[c] -= x
            levels = sorted((load[c], c) for c in a)
            # water level w: sum(max(0, w - load)) = d over the thread's CPUs
            remaining, level = d, levels[0][0]
            for n in range(1, len(levels) + 1):
                nxt = levels[n][0] if n < len(levels) else math.inf
                need = (nxt - level) * n
                if need >= remaining:
                    level += remaining / n
                    break
                remaining -= need
                level = nxt
            share = {c: max(0.0, level - x) for x, c in levels}
            spread[idx] = share
            for c, x in share.items():
                load[c] += x
    return load, spread


def _sibling_occupancy(affinity: CpuSet, siblings: Mapping[int, CpuSet], cpu_load: Mapping[int, float],
                       spread: Mapping[int, float], demand: float) -> float:
    """How busy a thread's SMT siblings are, in [0, 1]. Pinned away from its siblings: their load,
    weighted by where the thread runs. Allowed on whole cores (e.g. unpinned): the scheduler puts
    busy threads on idle cores first, so siblings are busy only for the load beyond one thread per
    core of the pool."""
    aset = set(affinity)
    cores = {tuple(sorted({c} | set(siblings.get(c, ())))) for c in aset}
    if any(len(core) > 1 and set(core) <= aset for core in cores):
        pool = set().union(*map(set, cores))
        load = sum(cpu_load.get(c, 0.0) for c in pool)
        return min(1.0, max(0.0, load - len(cores)) / len(cores))
    total = 0.0
    for c in aset:
        sib = [x for x in siblings.get(c, ()) if x != c and x in cpu_load]
        if not sib:
            continue
        weight = spread.get(c, 0.0) / demand if demand > 0 else 1.0 / len(aset)
        total += weight * min(1.0, sum(cpu_load[x] for x in sib) / len(sib))
    return min(1.0, total)


STATE_LIMIT = 1024
"""Scheduler states enumerated exactly up to this many; beyond, ``STATE_SAMPLES`` drawn at random
(a fixed seed: the same placement always gets the same prediction)."""
STATE_SAMPLES = 96


def _base_loads(pl: Placement, universe: CpuSet, free: Sequence[int], demand_p: Sequence[float],
                duties: Sequence[float]) -> Dict[int, float]:
    """Each CPU's demand from everything the balancer does not place in a state: other jobs
    (``reserved``), proxies pinned to one CPU, and busy threads (each at `duties`), a thread
    allowed on several CPUs spread evenly over them."""
    load = {c: min(1.0, max(0.0, float(pl.reserved.get(c, 0.0)))) for c in universe}
    fixed = [(p.cpus if p.cpus is not None else universe, demand_p[i])
             for i, p in enumerate(pl.proxies) if i not in free]
    fixed += [(b.cpus if b.cpus is not None else universe, d) for b, d in zip(pl.busy, duties)]
    for cpus, d in fixed:
        for c in cpus:
            load[c] += d / len(cpus)
    return load


def _proxy_demands(pl: Placement, eta: float, kappa: float) -> List[float]:
    """Each proxy's CPU demand: eta, or less when its lane is capped (by ``lane_rate``, or by an equal
    share of ``net_rate``) below what eta of a CPU would carry."""
    lanes = pl.lanes()
    lane_cap = {lane: pl.lane_rate for lane in lanes}
    if pl.net_rate is not None and lanes:
        for lane in lanes:
            share = pl.net_rate / len(lanes)
            lane_cap[lane] = share if lane_cap[lane] is None else min(lane_cap[lane], share)
    return [min(eta, kappa * lane_cap[p.lane]) if lane_cap[p.lane] is not None else eta for p in pl.proxies]


def _cores(pl: Placement, universe: CpuSet) -> Dict[int, CpuSet]:
    """cpu -> the usable CPUs of its physical core (itself and its SMT siblings)."""
    return {c: tuple(sorted(({c} | set(pl.siblings.get(c, ()))) & set(universe))) for c in universe}


def _loads(assign: Sequence[int], free: Sequence[int], demand_p: Sequence[float],
           base: Mapping[int, float], core_of: Mapping[int, CpuSet]) -> Tuple[Dict[int, float], Dict[CpuSet, float]]:
    load = dict(base)
    for i, c in zip(free, assign):
        load[c] += demand_p[i]
    core_load: Dict[CpuSet, float] = {}
    for c, x in load.items():
        core_load[core_of[c]] = core_load.get(core_of[c], 0.0) + x
    return load, core_load


def _unsettled(assign: Sequence[int], free: Sequence[int], choices: Sequence[CpuSet], demand_p: Sequence[float],
               base: Mapping[int, float], core_of: Mapping[int, CpuSet]) -> Optional[Tuple[int, int]]:
    """A move the load balancer would make, (index into `free`, CPU), or None when it leaves this
    assignment alone: no proxy's CPU holds more demand than another CPU it may use, and no
    proxy's physical core more than another core it may use, by more than the proxy's own
    demand (moving it there would narrow the gap, so the balancer would)."""
    load, core_load = _loads(assign, free, demand_p, base, core_of)
    for n, (i, c, allowed) in enumerate(zip(free, assign, choices)):
        b = min(allowed, key=lambda x: (load[x], x))
        if load[c] - load[b] > demand_p[i] + 1e-9:
            return n, b
        others = [x for x in allowed if core_of[x] != core_of[c]]
        if others:
            b = min(others, key=lambda x: (core_load[core_of[x]], load[x], x))
            if core_load[core_of[c]] - core_load[core_of[b]] > demand_p[i] + 1e-9:
                return n, b
    return None


def _settle(assign: List[int], free: Sequence[int], choices: Sequence[CpuSet], demand_p: Sequence[float],
            base: Mapping[int, float], core_of: Mapping[int, CpuSet]) -> List[int]:
    """Makes the balancer's moves until it would make none (bounded, for safety)."""
    for _ in range(10 * len(free) + 10):
        move = _unsettled(assign, free, choices, demand_p, base, core_of)
        if move is None:
            break
        assign[move[0]] = move[1]
    return assign


def _states(pl: Placement, kappa: float = 1.0, eta: float = 1.0) -> List[Tuple[float, Placement]]:
    """The states the scheduler moves a placement between, each with its share of the time.

    * **Unpinned proxies: where the load balancer leaves them.** A proxy runs in bursts and sleeps
      on its ring neighbour, so the kernel places it again at every wake-up; but a runnable thread
      does not stay queued behind another while a CPU it may use is idle or less loaded (the
      idle CPU pulls it at once, the periodic balancer evens the queues). So the states are the
      assignments of the unpinned proxies to CPUs that the balancer leaves alone (``_unsettled``
      finds none of its moves: no proxy's CPU, nor its physical core, is busier than another it
      may use by more than the proxy's own demand), each equally likely: nothing else ties a proxy
      to its ring neighbour. On two idle CPUs the two ends of a lane are always apart; on idle SMT
      cores, on separate cores. Parameter-free. (Exact up to ``STATE_LIMIT`` assignments; beyond,
      ``STATE_SAMPLES`` seeded random assignments, each settled by ``_settle``.)
    * **Duty-cycled threads.** A busy thread with duty d < 1 is runnable a fraction d of the time
      and then competes for its CPU like any busy thread; the other 1 - d its CPU is free. The
      balancer settles the proxies anew in each of these.

    A placement without either is its own single state."""
    universe = tuple(sorted(pl.cpus))
    choices: List[CpuSet] = []
    free: List[int] = []
    for i, p in enumerate(pl.proxies):
        allowed = tuple(sorted(p.cpus)) if p.cpus is not None else universe
        if len(allowed) > 1:
            free.append(i)
            choices.append(allowed)
    cycling = [j for j, b in enumerate(pl.busy) if 0.0 < b.duty < 1.0]
    if not free and not cycling:
        return [(1.0, pl)]
    demand_p = _proxy_demands(pl, eta, kappa)
    core_of = _cores(pl, universe)

    def state(cpus: Sequence[int], on: Sequence[bool]) -> Placement:
        proxies = list(pl.proxies)
        for i, c in zip(free, cpus):
            proxies[i] = ProxySpec(proxies[i].lane, (c,))
        busy = list(pl.busy)
        for j, running in zip(cycling, on):
            busy[j] = Busy(busy[j].cpus, 1.0 if running else 0.0)
        return dataclasses.replace(pl, proxies=tuple(proxies), busy=tuple(busy))

    def duties_in(on: Sequence[bool]) -> List[float]:
        d = [min(1.0, max(0.0, b.duty)) for b in pl.busy]
        for j, running in zip(cycling, on):
            d[j] = 1.0 if running else 0.0
        return d

    n_assign = 1
    for allowed in choices:
        n_assign *= len(allowed)
        if n_assign * 2 ** len(cycling) > STATE_LIMIT:
            break
    out: List[Tuple[float, Placement]] = []
    if n_assign * 2 ** len(cycling) <= STATE_LIMIT:
        for on in itertools.product((True, False), repeat=len(cycling)):
            w_on = math.prod(pl.busy[j].duty if o else 1.0 - pl.busy[j].duty for j, o in zip(cycling, on))
            if w_on <= 0:
                continue
            base = _base_loads(pl, universe, free, demand_p, duties_in(on))
            every = list(itertools.product(*choices))
            settled = [cpus for cpus in every if _unsettled(cpus, free, choices, demand_p, base, core_of) is None]
            if not settled:  # cannot happen on CPUs alone; guards the core-level rule
                settled = [tuple(_settle(list(cpus), free, choices, demand_p, base, core_of)) for cpus in every]
            for cpus in settled:
                out.append((w_on / len(settled), state(cpus, on)))
        return out
    rng = random.Random(0)
    for _ in range(STATE_SAMPLES):
        on = [rng.random() < pl.busy[j].duty for j in cycling]
        base = _base_loads(pl, universe, free, demand_p, duties_in(on))
        cpus = _settle([rng.choice(a) for a in choices], free, choices, demand_p, base, core_of)
        out.append((1.0 / STATE_SAMPLES, state(cpus, on)))
    return out


def _predict(pl: Placement, kappa: float, eta: float, gamma: float, beta: float, delta: float = 0.0,
             gamma_busy: Optional[float] = None) -> Prediction:
    """The time average over the scheduler's states (``_states``) of each state's prediction: rates
    and CPU shares weighted by time, each proxy's per-byte cost and its regressors (m, c, o, s) by
    the bytes it carries in each state (what a measured CPU-seconds per byte averages)."""
    states = _states(pl, kappa, eta)
    if len(states) == 1:
        return _predict_state(pl, kappa, eta, gamma, beta, delta, gamma_busy)
    preds = [(w, _predict_state(s, kappa, eta, gamma, beta, delta, gamma_busy)) for w, s in states]
    lanes = pl.lanes()
    n_p, n_b = len(pl.proxies), len(pl.busy)
    lane_rates = {lane: sum(w * p.lane_rates[lane] for w, p in preds) for lane in lanes}
    proxy_cpu = [sum(w * p.proxy_cpu[i] for w, p in preds) for i in range(n_p)]
    busy_cpu = [sum(w * p.busy_cpu[j] for w, p in preds) for j in range(n_b)]

    def by_bytes(field: str, i: int) -> float:
        num = sum(w * p.proxy_rates[i] * getattr(p, field)[i] for w, p in preds)
        den = sum(w * p.proxy_rates[i] for w, p in preds)
        return num / den if den > 0 else sum(w * getattr(p, field)[i] for w, p in preds)

    fields = ("proxy_kappa", "proxy_crowding", "proxy_sibling", "proxy_peer", "proxy_clustered",
              "proxy_clustered_busy", "proxy_peer_clustered")
    avg = {f: [by_bytes(f, i) for i in range(n_p)] for f in fields}
    proxy_rates = [lane_rates[p.lane] for p in pl.proxies]
    total = sum(lane_rates.values())
    equal = len(lanes) * min(lane_rates.values()) if lanes else 0.0
    return Prediction(lane_rates, proxy_rates, proxy_cpu, busy_cpu, avg["proxy_kappa"], total, equal,
                      avg["proxy_crowding"], avg["proxy_sibling"], avg["proxy_peer"], avg["proxy_clustered"],
                      avg["proxy_clustered_busy"], avg["proxy_peer_clustered"], states=len(states))


def _predict_state(pl: Placement, kappa: float, eta: float, gamma: float, beta: float, delta: float = 0.0,
                   gamma_busy: Optional[float] = None) -> Prediction:
    """One scheduler state: every proxy's CPUs as given (a proxy allowed on several CPUs is spread
    over them as a fluid), every busy thread wanting its duty."""
    universe = tuple(sorted(pl.cpus))
    if not universe:
        raise ValueError("a placement needs at least one usable CPU")
    for spec in list(pl.proxies) + list(pl.busy):
        if spec.cpus is not None and (not spec.cpus or not set(spec.cpus) <= set(universe)):
            raise ValueError(f"affinity {spec.cpus} is not within the usable CPUs {universe}")
    aff_p = [tuple(sorted(p.cpus)) if p.cpus is not None else universe for p in pl.proxies]
    aff_b = [tuple(sorted(b.cpus)) if b.cpus is not None else universe for b in pl.busy]
    duties = [min(1.0, max(0.0, b.duty)) for b in pl.busy]
    lanes = pl.lanes()

    # demand of each thread, for how crowded its CPUs are (a network-capped lane wants less)
    demand_p = _proxy_demands(pl, eta, kappa)
    entities = list(zip(aff_p, demand_p)) + list(zip(aff_b, duties))

    # constraint sets: every union of distinct affinities (all subsets when few), capacity = size
    distinct = sorted(set(aff_p) | set(aff_b))
    sets = set(distinct) | {universe}
    if len(distinct) <= 10:
        for r in range(2, len(distinct) + 1):
            for combo in itertools.combinations(distinct, r):
                sets.add(tuple(sorted(set().union(*combo))))
    sets = sorted(sets, key=lambda s: (len(s), s))

    # per-byte cost of each proxy: crowding m_p and SMT sibling occupancy o_p, from each logical
    # CPU's load once the scheduler has spread every thread's demand over its affinity
    reserved = {c: min(1.0, max(0.0, float(pl.reserved.get(c, 0.0)))) for c in universe}
    cpu_load, spread = _balanced_loads(universe, entities, base=reserved)
    kap: List[float] = []
    ms: List[float] = []
    cls_: List[float] = []
    cls_busy: List[float] = []
    g_busy = gamma if gamma_busy is None else gamma_busy
    occs: List[float] = []
    peers: List[float] = []
    peers_cls: List[float] = []
    proxy_load = {c: sum(spread[q].get(c, 0.0) for q in range(len(aff_p))) for c in universe}
    for i, a in enumerate(aff_p):
        d = demand_p[i]
        where = {c: spread[i].get(c, 0.0) / d for c in a} if d > 0 else {c: 1.0 / len(a) for c in a}
        mates = [q for q, other in enumerate(pl.proxies) if q != i and other.lane == pl.proxies[i].lane]
        # the ring neighbours of p's lane on p's CPUs: they run while p waits for their bytes (a
        # hand-over), so they are not co-runners that crowd p
        mate_load = {c: sum(spread[q].get(c, 0.0) for q in mates) for c in a}
        m = sum(w * (cpu_load[c] - mate_load[c]) for c, w in where.items())
        m = max(1.0, m)
        clustered = min(1.0, m - 1.0)
        # who the co-runners are: other proxies, or busy threads (and other jobs)
        others_p = sum(w * (proxy_load[c] - spread[i].get(c, 0.0) - mate_load[c]) for c, w in where.items())
        others_b = sum(w * (cpu_load[c] - proxy_load[c]) for c, w in where.items())
        clustered_busy = clustered * others_b / (others_p + others_b) if others_p + others_b > 1e-12 else 0.0
        occ = _sibling_occupancy(a, pl.siblings, cpu_load, spread[i], d)
        peer = 0.0
        for q in mates:
            if demand_p[q] > 0 and d > 0:
                peer += sum(spread[i].get(c, 0.0) / d * min(1.0, spread[q].get(c, 0.0) / demand_p[q]) for c in a)
        peer = min(1.0, peer)
        ms.append(m)
        cls_.append(clustered)
        cls_busy.append(clustered_busy)
        occs.append(occ)
        peers.append(peer)
        peers_cls.append(peer * clustered)
        kap.append(kappa * max(0.05, 1.0 + gamma * (clustered - clustered_busy) + g_busy * clustered_busy
                               + beta * occ - delta * peer * clustered))

    # progressive filling over a level lam (CPU-time a thread may take): lane l runs at
    # min(lam, eta) / max kappa_p of its proxies (capped by lane_cap), proxy p uses kappa_p * rate,
    # busy thread b uses min(lam, duty_b).
    lane_members = {lane: [i for i, p in enumerate(pl.proxies) if p.lane == lane] for lane in lanes}
    lane_kmax = {lane: max(kap[i] for i in lane_members[lane]) for lane in lanes}
    lane_lcap = {}
    for lane in lanes:
        c = eta
        if pl.lane_rate is not None:
            c = min(c, pl.lane_rate * lane_kmax[lane])
        lane_lcap[lane] = c
    frozen_lane: Dict[int, float] = {}
    frozen_busy: Dict[int, float] = {}
    lam = 0.0
    while len(frozen_lane) < len(lanes) or len(frozen_busy) < len(pl.busy):
        earliest, tight = None, []
        constraints = [("cpu", s) for s in sets] + ([("net", None)] if pl.net_rate is not None else [])
        for kind, s in constraints:
            loads, fixed = [], 0.0
            if kind == "cpu":
                ss = set(s)
                for lane in lanes:
                    for i in lane_members[lane]:
                        if set(aff_p[i]) <= ss:
                            ratio = kap[i] / lane_kmax[lane]
                            if lane in frozen_lane:
                                fixed += kap[i] * frozen_lane[lane]
                            else:
                                loads.append((ratio, lane_lcap[lane]))
                for j, a in enumerate(aff_b):
                    if set(a) <= ss:
                        if j in frozen_busy:
                            fixed += frozen_busy[j]
                        else:
                            loads.append((1.0, duties[j]))
                capacity = max(1e-9, float(len(s)) - sum(reserved[c] for c in s))
            else:
                for lane in lanes:
                    if lane in frozen_lane:
                        fixed += frozen_lane[lane]
                    else:
                        loads.append((1.0 / lane_kmax[lane], lane_lcap[lane]))
                capacity = pl.net_rate
            if not loads:
                continue
            root = _first_root(loads, fixed, capacity, lam)
            if root is None:
                continue
            if earliest is None or root < earliest - 1e-12:
                earliest, tight = root, [(kind, s)]
            elif abs(root - earliest) <= 1e-12:
                tight.append((kind, s))
        if earliest is None:  # every thread reaches its own cap
            for lane in lanes:
                frozen_lane.setdefault(lane, lane_lcap[lane] / lane_kmax[lane])
            for j in range(len(pl.busy)):
                frozen_busy.setdefault(j, duties[j])
            break
        lam = earliest
        for kind, s in tight:
            if kind == "net":
                for lane in lanes:
                    frozen_lane.setdefault(lane, min(lam, lane_lcap[lane]) / lane_kmax[lane])
                continue
            ss = set(s)
            for lane in lanes:
                if any(set(aff_p[i]) <= ss for i in lane_members[lane]):
                    frozen_lane.setdefault(lane, min(lam, lane_lcap[lane]) / lane_kmax[lane])
            for j, a in enumerate(aff_b):
                if set(a) <= ss:
                    frozen_busy.setdefault(j, min(lam, duties[j]))

    lane_rates = {lane: frozen_lane[lane] for lane in lanes}
    proxy_rates = [lane_rates[p.lane] for p in pl.proxies]
    proxy_cpu = [kap[i] * proxy_rates[i] for i in range(len(pl.proxies))]
    busy_cpu = [frozen_busy[j] for j in range(len(pl.busy))]
    total = sum(lane_rates.values())
    equal = len(lanes) * min(lane_rates.values()) if lanes else 0.0
    return Prediction(lane_rates, proxy_rates, proxy_cpu, busy_cpu, kap, total, equal, ms, occs, peers, cls_,
                      cls_busy, peers_cls)


# -- planning ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """k proxies; ``proxy_cpus[j]`` is lane j's CPU set (None: no pinning); ``worker_cpus`` the CPUs
    to leave the training compute (None: no pinning); the predicted rate (wire bytes/s sent by this
    host's proxies), the compute's predicted CPU share, and why."""

    k: int
    proxy_cpus: Optional[List[CpuSet]]
    worker_cpus: Optional[CpuSet]
    rate: float
    compute_share: float
    reason: str
    candidates: List[dict] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["proxy_cpus"] = None if self.proxy_cpus is None else [list(c) for c in self.proxy_cpus]
        d["worker_cpus"] = None if self.worker_cpus is None else list(self.worker_cpus)
        return d


def _proxy_cpu_order(topo: Topology, node: Optional[int]) -> List[int]:
    """CPUs for proxies, best first: cores on the NIC's NUMA node (if known) first, the
    highest-numbered physical cores first (the compute keeps the low ones), and one CPU of every
    core before any SMT sibling."""
    cores = list(enumerate(topo.cores()))
    cores.sort(key=lambda ic: (node is not None and topo.node_of.get(ic[1][0], 0) != node, -ic[0]))
    order: List[int] = []
    for r in range(max((len(c) for _, c in cores), default=0)):
        order.extend(core[r] for _, core in cores if r < len(core))
    return order


def plan(topology: Topology, compute_cpus: int, net_rate: Optional[float], model: PlacementModel, *,
         max_k: Optional[int] = None, nic_node: Optional[int] = None, tolerance: float = 0.05,
         min_compute_share: float = 0.95) -> Plan:
    """Chooses k and a pinning for one worker's proxies.

    `compute_cpus`: busy CPU threads the training wants (torch intra-op threads, data loading; at
    least the Python thread); `net_rate`: wire bytes/s the lanes could carry together (the path
    probe's best aggregate; None: unknown, CPU is the only limit). Candidates: k = 1..max_k
    proxies either unpinned (the compute too), or pinned round-robin on d dedicated CPUs (separate
    physical cores first, on `nic_node` first) with the compute pinned to the other CPUs (or, when
    none is left, free to run anywhere). Among candidates that leave the compute at least
    `min_compute_share` of its CPUs (or, if none can, those that leave it the most), it takes the
    fewest proxies, then the fewest dedicated CPUs, within `tolerance` of the best predicted rate."""
    cpus = tuple(topology.cpus)
    if not cpus:
        raise ValueError("no usable CPUs")
    compute_cpus = max(0, int(compute_cpus))
    if max_k is None:
        max_k = min(8, 2 * len(cpus))
    siblings = {c: topology.siblings(c) for c in cpus}
    order = _proxy_cpu_order(topology, nic_node)
    candidates = []
    for k in range(1, max_k + 1):
        # no pinning: k proxies and the compute threads anywhere
        pl = Placement(cpus, tuple(ProxySpec(j) for j in range(k)), tuple(Busy() for _ in range(compute_cpus)),
                       siblings, net_rate=net_rate)
        candidates.append((k, 0, None, None, model.predict(pl)))
        for d in range(1, min(k, len(cpus)) + 1):
            dedicated = tuple(order[:d])
            rest = tuple(c for c in cpus if c not in dedicated)
            # the compute keeps off the proxies' physical cores when the other cores suffice
            apart = tuple(c for c in rest if not set(siblings[c]) & set(dedicated))
            if apart and len(apart) >= compute_cpus:
                rest = apart
            proxy_cpus = [(dedicated[j % d],) for j in range(k)]
            workers = [rest] if len(rest) >= compute_cpus and rest else []
            if len(rest) < compute_cpus or not rest:
                workers.append(None)  # too few CPUs left: the compute also runs anywhere
            for worker in workers:
                pl = Placement(cpus, tuple(ProxySpec(j, proxy_cpus[j]) for j in range(k)),
                               tuple(Busy(worker) for _ in range(compute_cpus)), siblings, net_rate=net_rate)
                candidates.append((k, d, proxy_cpus, worker, model.predict(pl)))
    rows = []
    for k, d, proxy_cpus, worker, pred in candidates:
        share = (sum(pred.busy_cpu) / compute_cpus) if compute_cpus else 1.0
        rows.append({"k": k, "dedicated_cpus": d, "proxy_cpus": proxy_cpus, "worker_cpus": worker,
                     "rate": pred.aggregate, "compute_share": share})
    best_share = max(r["compute_share"] for r in rows)
    floor = min(min_compute_share, best_share - 1e-9)
    eligible = [r for r in rows if r["compute_share"] >= floor - 1e-9]
    best_rate = max(r["rate"] for r in eligible)
    good = [r for r in eligible if r["rate"] >= (1.0 - tolerance) * best_rate]
    # fewest proxies, then no pinning over pinning at equal k (pinning only when it pays), then fewest CPUs
    choice = min(good, key=lambda r: (r["k"], r["dedicated_cpus"] != 0, r["dedicated_cpus"], -r["rate"]))
    if choice["dedicated_cpus"] == 0:
        where = "unpinned"
    else:
        where = f"pinned to CPUs {sorted(set(c for cs in choice['proxy_cpus'] for c in cs))}"
        where += f", compute on {list(choice['worker_cpus'])}" if choice["worker_cpus"] else ", compute unpinned"
    limit = ""
    if net_rate is not None and choice["rate"] >= net_rate * (1 - 1e-6):
        limit = "network-bound: more proxies would not help"
    elif choice["k"] < max_k:
        limit = f"more proxies add < {tolerance:.0%}"
    else:
        limit = "CPU-bound at the largest k tried"
    compute_note = ("" if choice["compute_share"] >= min_compute_share - 1e-9 else
                    f"; compute keeps only {choice['compute_share']:.0%} of its {compute_cpus} CPUs")
    reason = (f"k={choice['k']} {where}: predicted {choice['rate'] / 1e6:.0f} MB/s "
              f"(best {best_rate / 1e6:.0f}; {limit}{compute_note})")
    return Plan(choice["k"], choice["proxy_cpus"], choice["worker_cpus"], choice["rate"],
                choice["compute_share"], reason, rows)


# -- the unit costs the model starts from -----------------------------------------------------------

_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def per_cpu_seconds() -> Dict[int, List[float]]:
    """{cpu: its first eight /proc/stat counters in seconds}: user, nice, system, idle, iowait,
    irq, softirq, steal (0 where the kernel gives fewer). psutil lists the online CPUs in order,
    without their numbers; those come from the kernel's list of online CPUs (0, 1, ... when it
    cannot be read or disagrees)."""
    times = psutil.cpu_times(percpu=True)
    online = parse_cpu_list(_read("/sys/devices/system/cpu/online") or "")
    cpus = online if len(online) == len(times) else range(len(times))
    return {cpu: [float(getattr(t, name, 0.0)) for name in _CPU_FIELDS] for cpu, t in zip(cpus, times)}


def cpu_times() -> Dict[int, Tuple[float, float]]:
    """{cpu: (busy_seconds, softirq_seconds)} from /proc/stat (busy = all but idle and iowait)."""
    return {cpu: (v[0] + v[1] + v[2] + v[5] + v[6] + v[7], v[6]) for cpu, v in per_cpu_seconds().items()}


def measure_unit_costs(cpu: Optional[int] = None, shard_bytes: int = 64 << 20,
                       socket_bytes: int = 256 << 20) -> Dict[str, float]:
    """CPU-seconds per byte of the proxies' float32 reduce (``reduce``), a memcpy (``copy``), each
    the best of three, and loopback TCP (``socket_send``, ``socket_recv``, ``socket`` = both),
    charged to the threads' CPU time as a proxy's is. With `cpu`, everything runs pinned to that
    CPU and ``socket_softirq`` is the kernel's softirq time there per byte."""
    import socket
    import threading

    import numpy as np

    from fasthorovod import _C
    try:
        import fasthorovod_testing  # the reduce kernel alone; built by make testing-module
    except ImportError as e:
        raise ImportError("measure_unit_costs needs the test-only module fasthorovod_testing: run "
                          "make testing-module and put tests/native on sys.path") from e

    mib = 1 << 20
    old = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        f32 = _C.DTYPES["float32"]
        shard = np.ones(shard_bytes // 4, dtype=np.float32)
        temp = np.ones(mib // 4, dtype=np.float32)
        dst = np.zeros_like(shard)
        seg = mib // 4
        best: Dict[str, float] = {}
        for name in ("reduce", "copy"):
            samples = []
            for _ in range(3):
                t0 = time.thread_time()
                if name == "reduce":
                    for i in range(0, shard.size, seg):
                        fasthorovod_testing.reduce_sum(f32, shard[i:i + seg], temp)
                else:
                    np.copyto(dst, shard)
                samples.append((time.thread_time() - t0) / shard.nbytes)
            best[name] = min(samples)
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        cli = socket.create_connection(srv.getsockname())
        conn, _ = srv.accept()
        recv_cpu: List[float] = []

        def receiver() -> None:
            view = memoryview(bytearray(mib))
            got, t0 = 0, time.thread_time()
            while got < socket_bytes:
                n = conn.recv_into(view)
                if n == 0:
                    break
                got += n
            recv_cpu.append(time.thread_time() - t0)

        payload = bytes(mib)
        th = threading.Thread(target=receiver)
        s0 = cpu_times()[cpu][1] if cpu is not None else 0.0
        th.start()
        t0 = time.thread_time()
        for _ in range(socket_bytes // mib):
            cli.sendall(payload)
        send_cpu = time.thread_time() - t0
        th.join()
        if cpu is not None:
            best["socket_softirq"] = (cpu_times()[cpu][1] - s0) / socket_bytes
        for s in (cli, conn, srv):
            s.close()
        best["socket_send"] = send_cpu / socket_bytes
        best["socket_recv"] = recv_cpu[0] / socket_bytes
        best["socket"] = (send_cpu + recv_cpu[0]) / socket_bytes
        return best
    finally:
        os.sched_setaffinity(0, old)

"""An emulated public-cloud network on one machine, for running multi-host jobs locally.

Public clouds give a VM a NIC of some link rate but cap what a single TCP flow can carry well
below it (e.g. 5 Gbit/s per flow on a 25 Gbit/s instance). FastHorovod exists to use many flows
per worker, so its local tests and benchmarks need a network with exactly that property. This
package builds one from Linux network namespaces:

- Every emulated host is a network namespace (``PREFIX-ID-h0``, ``PREFIX-ID-h1``, ...) with
  loopback and one interface, ``eth0``, holding the host's address in a private /24
  (``10.231.N.0/24``, chosen so that it overlaps no address of this machine). Those addresses
  exist only inside the emulation; nothing is routed to or from the machine's own network.
- The hosts are joined by a Linux bridge that lives in a namespace of its own (``PREFIX-ID-br``),
  so the machine's root namespace is never touched. Each host's ``eth0`` is one end of a veth
  pair whose other end (``h0``, ``h1``, ...) is a port of that bridge.
- Shaping happens on both ends of every veth pair: on ``eth0`` (what the host sends) and on the
  bridge port (what the host receives), each with an ``htb`` tree that caps the device at the
  LINK rate and every TCP flow at the PER_FLOW rate, the flow picked by hashing its port pair
  into 256 buckets (see ``shaping``). Both ends use that host's own rates, which per-host
  overrides can change (``3:1gbit:200mbit,host1=50mbit``, see ``spec``): a flow between two
  hosts then gets the smaller of their per-flow caps. There is no added latency and no loss: the
  ``netem`` qdisc is not available on the machines we run on.
- Inside each host namespace ``/etc/hosts`` (``/etc/netns/NS/hosts``, which ``ip netns exec``
  mounts over it) maps the machine's hostname to the host's address, because Gloo resolves the
  hostname to find its own address, and maps every host's namespace name to its address.

- The bridge's namespace is also the *launcher namespace*: an ``eth0`` on an unshaped bridge port
  with the subnet's last address, from which launchers reach the hosts (``host0``, ``host1``, ...
  resolve in every namespace). With ``ssh=True`` every host runs an sshd with keys made for the
  instance (``ssh``), so ``horovodrun -H host0:P,...`` run there starts ranks as on a cluster; a
  discovery script lists the hosts that are up, and ``host_down``/``host_up`` emulate spot
  preemption.

Processes run in a host with ``run_in_host(host, argv)`` (``ip netns exec NS ...``). Every
instance records what it created in ``/run/fasthorovod-netem/ID.json`` before creating it, so
``down()`` and ``cleanup_stale()`` can always remove it all, even after a crash.
"""

from .cloud import DEFAULT_PREFIX, EmulatedCloud, cleanup_stale, down_all, exec_prefix, run_in_host
from .errors import NetemError, NetemPermissionError
from .spec import CloudSpec, HostRates, format_rate, parse_rate, parse_spec
from .state import Host, InstanceState, list_instances

__all__ = [
    "DEFAULT_PREFIX",
    "CloudSpec",
    "EmulatedCloud",
    "Host",
    "HostRates",
    "InstanceState",
    "NetemError",
    "NetemPermissionError",
    "cleanup_stale",
    "down_all",
    "exec_prefix",
    "format_rate",
    "list_instances",
    "parse_rate",
    "parse_spec",
    "run_in_host",
]

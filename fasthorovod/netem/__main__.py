"""Command line: ``python -m fasthorovod.netem {up,down,status,check,host-down,host-up}`` (see ``--help``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import ssh as ssh_hosts
from .check import MANY_FLOWS, MANY_FLOWS_MIN, ONE_FLOW_BOUNDS, run_check
from .cloud import DEFAULT_PREFIX, EmulatedCloud, down_all
from .errors import NetemError
from .spec import format_rate, parse_spec
from .state import InstanceState, list_instances

SPEC_HELP = (
    "HOSTS:LINK_RATE:PER_FLOW_RATE[,hostI=PER_FLOW_RATE | ,hostI=LINK_RATE:PER_FLOW_RATE]...[,buckets=N][,hashbit=K], "
    "e.g. 4:1gbit:200mbit, 5:1gbit:200mbit,host1=100mbit,host3=500mbit:150mbit for hosts on slower paths, "
    "or 4:1gbit:200mbit,buckets=16 for a cloud where flows often share a per-flow cap "
    "(rates in bit/s with tc units bit, kbit, mbit, gbit; a plain number is bit/s)"
)
DESCRIPTION = """\
Emulate a public-cloud network on this machine: HOSTS network namespaces joined by a bridge (in a
namespace of its own), each host's link capped at LINK_RATE in and out, and each TCP flow capped at
PER_FLOW_RATE (flows are hashed into 256 buckets by port, so unlucky flows share a cap; `,buckets=N`
sets N, a power of 4 from 4 to 1024, and `,hashbit=K` the lowest port bit hashed, 1 by default). No
latency or loss is added. Needs root. Run a command in a host with `ip netns exec NAMESPACE COMMAND`.
Every namespace resolves the hosts as host0, host1, ... and the launcher namespace (the bridge's,
with an eth0 of its own) as launcher. With `up --ssh` every host runs an sshd, so that
`ip netns exec BRIDGE_NAMESPACE horovodrun -H host0:1,host1:1 ...` starts ranks over ssh as on a
real cluster; `host-down` and `host-up` take a host away (spot preemption) and bring it back.

An uneven cloud gives some hosts other rates: after the base spec, `,hostI=PER_FLOW_RATE` changes
host I's per-flow cap (I counts from 0; host I's namespace ends in -hI) and `,hostI=LINK:PER_FLOW`
its link and per-flow cap, e.g. 5:1gbit:200mbit,host1=100mbit,host3=500mbit:150mbit (a host across
racks or zones). A host's rates apply to what it sends and what it receives, so a flow between two
hosts gets the smaller per-flow cap of the two.
"""


def _describe(state: InstanceState) -> str:
    owner = "detached" if state.owner_pid is None else f"owner pid {state.owner_pid}"
    if not state.owner_alive():
        owner += " (dead; removed by the next up or cleanup)"
    lines = [f"emulated cloud {state.id}: {state.spec}, prefix {state.prefix}, subnet {state.subnet}, {owner}"]
    spec = parse_spec(state.spec)
    for index, host in enumerate(state.hosts):
        link, per_flow = spec.host_rates(index)
        rates = f"\thost{index}: link {format_rate(link)}, per flow {format_rate(per_flow)}" if spec.uneven else ""
        lines.append(f"  {host.name}\t{host.address}{rates}")
    lines.append(f"  bridge namespace {state.bridge_namespace}"
                 + (f", launcher address {state.launcher_address} (eth0)" if state.launcher_address else ""))
    if state.ssh:
        lines.append(f"  sshd on every host, port {ssh_hosts.SSH_PORT}; identity file {ssh_hosts.identity_file(state)}")
    if state.launcher_address:
        lines.append(f"  host discovery script {state.directory / 'discover-hosts'}")
    lines.append(f"  state {state.path}")
    return "\n".join(lines)


def _availability(state: InstanceState) -> list[str]:
    """A line per host that is away (unlisted by discovery, link cut), for a cloud that is up."""
    cloud = EmulatedCloud.attach(state.id)
    try:
        listed = set(cloud.available_hosts())
    except OSError:
        return []
    lines = []
    for index in range(len(state.hosts)):
        link = cloud.link_up(index)
        if index not in listed or not link:
            lines.append(f"  host{index} is away: " + ("unlisted" if index not in listed else "listed")
                         + ("" if link else ", link cut"))
    return lines


def _up(args: argparse.Namespace) -> int:
    cloud = EmulatedCloud(parse_spec(args.spec), args.prefix, detached=True, ssh=args.ssh,
                          slots_per_host=args.slots).up()
    print(_describe(cloud.state))
    print(f"run in a host:  ip netns exec {cloud.hosts[0].name} COMMAND")
    if args.ssh:
        hosts = ",".join(f"{name}:{args.slots}" for name in cloud.host_names())
        print(f"launch:         ip netns exec {cloud.launcher_namespace} horovodrun -np "
              f"{args.slots * len(cloud.hosts)} -H {hosts} COMMAND")
    print(f"tear down:      python -m fasthorovod.netem down {cloud.id}")
    return 0


def _host_down(args: argparse.Namespace) -> int:
    cloud = EmulatedCloud.attach(args.id)
    index = cloud.host_index(args.host)
    killed = cloud.host_down(index, abrupt=args.abrupt)
    how = f"link cut, {len(set(killed))} processes killed, " if args.abrupt else ""
    print(f"host{index} ({cloud.hosts[index].name}) is down: {how}no longer listed by {cloud.discovery_script}")
    return 0


def _host_up(args: argparse.Namespace) -> int:
    cloud = EmulatedCloud.attach(args.id)
    index = cloud.host_index(args.host)
    cloud.host_up(index)
    sshd = ", sshd running" if cloud.state.ssh else ""
    print(f"host{index} ({cloud.hosts[index].name}) is up: link up{sshd}, listed by {cloud.discovery_script}")
    return 0


def _down(args: argparse.Namespace) -> int:
    if args.all:
        removed = down_all(args.prefix)
        print(f"removed: {' '.join(removed)}" if removed else f"nothing with prefix {args.prefix!r} to remove")
    else:
        EmulatedCloud.attach(args.id).down()
        print(f"removed: {args.id}")
    return 0


def _status(args: argparse.Namespace) -> int:
    states = list_instances(args.prefix)
    described = []
    for state in states:
        lines = [_describe(state)]
        if state.owner_alive() and state.launcher_address:
            try:
                lines += _availability(state)
            except NetemError:  # going down right now
                pass
        described.append("\n".join(lines))
    print("\n".join(described) if states else "no emulated cloud is up")
    return 0


def _check(args: argparse.Namespace) -> int:
    result = run_check(parse_spec(args.spec), args.prefix, seconds=args.seconds, ring=args.ring)
    print(result.report())
    return 0 if result.passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fasthorovod.netem",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser(
        "up",
        help="bring a network up and leave it up",
        description="Bring a network up and leave it up "
        "(until `down ID`); prints the hosts, their addresses and the JSON state file.",
    )
    up.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    up.add_argument("--ssh", action="store_true",
                    help="run an sshd on every host (keys generated for this network only), so that launchers "
                         "run in the bridge namespace reach the hosts over ssh (horovodrun -H host0:P,...)")
    up.add_argument("--slots", type=int, default=1, metavar="P",
                    help="slots per host printed by the host discovery script (default 1)")
    up.set_defaults(run=_up)

    host_down = commands.add_parser(
        "host-down", help="take a host away (spot preemption)",
        description="Take a host away, as a spot instance is reclaimed. Graceful (default): the host discovery "
        "script stops listing it (an elastic job stops using it), nothing else changes. --abrupt: its link is cut "
        "first (its bridge port goes down, so no FIN or RST gets out), then every process in it is killed (sshd "
        "and ranks included), then it is unlisted.")
    host_down.add_argument("id", metavar="ID", help="id printed by `up` (see `status`)")
    host_down.add_argument("host", metavar="HOST", help="hostI, I, or the host's namespace name")
    host_down.add_argument("--abrupt", action="store_true", help="cut its link and kill its processes")
    host_down.set_defaults(run=_host_down)

    host_up = commands.add_parser(
        "host-up", help="bring a host back",
        description="Bring a host back: its link up, its sshd started again (with --ssh), listed by the host "
        "discovery script again.")
    host_up.add_argument("id", metavar="ID", help="id printed by `up` (see `status`)")
    host_up.add_argument("host", metavar="HOST", help="hostI, I, or the host's namespace name")
    host_up.set_defaults(run=_host_up)

    down = commands.add_parser("down", help="tear a network down", description="Tear down one network, or all.")
    which = down.add_mutually_exclusive_group(required=True)
    which.add_argument("id", metavar="ID", nargs="?", help="id printed by `up` (see `status`)")
    which.add_argument("--all", action="store_true", help="every network with --prefix, and any leftovers")
    down.set_defaults(run=_down)

    status = commands.add_parser("status", help="list the networks that are up", description="List networks.")
    status.set_defaults(run=_status)

    check = commands.add_parser(
        "check",
        help="bring a network up, measure it with iperf3, tear it down",
        description=f"Bring SPEC up, measure with iperf3 (1 flow, then {MANY_FLOWS} flows) host0 -> host1, tear it "
        "down. On an uneven cloud the paths are the first two hosts without an override (when there are two) and "
        "every overridden host, out of it and into it, each against the host with the highest per-flow cap among "
        "the others. Exit code 0 when on every path 1 flow gets "
        f"{ONE_FLOW_BOUNDS[0]}-{ONE_FLOW_BOUNDS[1]} x the path's per-flow cap (the smaller of its two hosts') and "
        f"{MANY_FLOWS} flows get >= {MANY_FLOWS_MIN} x the smaller of the path's link and one per-flow cap per "
        "flow bucket they hashed into (flows in one bucket share a cap), else 1.",
    )
    check.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    check.add_argument("--seconds", type=float, default=3.0, help="length of each iperf3 test (default 3)")
    check.add_argument(
        "--ring",
        action="store_true",
        help="also measure every host sending to the next at once (3 x link / per-flow cap flows each, at "
        f"least {MANY_FLOWS}: enough to fill the link): the most a ring allreduce can get from this "
        "emulation on this machine's CPUs (reported, not judged)",
    )
    check.set_defaults(run=_check)

    for command in (up, down, check):
        command.add_argument(
            "--prefix", default=DEFAULT_PREFIX, help=f"namespace name prefix (default {DEFAULT_PREFIX})"
        )
    status.add_argument("--prefix", help="only networks with this namespace name prefix (default: all)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        exit_code: int = args.run(args)
        return exit_code
    except ValueError as err:
        parser.error(str(err))
    except NetemError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The ``fasthorovodrun`` command line: Horovod's horovodrun parser plus FastHorovod's flags.

The parser is not a copy of horovodrun's: ``horovod.runner.launch.parse_args`` builds its parser
and parses ``sys.argv`` in one function, so ``parse_args`` here runs that very function with
``ArgumentParser.parse_args`` intercepted for its one call. The interception adds the
"FastHorovod arguments" group to Horovod's parser object and parses our ``argv`` with it; Horovod's
post-processing (``--config-file``, validation, ``--check-build``) then runs unchanged. So every
horovodrun flag, default, check and help text is Horovod 0.28.1's own.

FastHorovod's flags only set environment variables (``fasthorovod_env``). Without
``--emulate-cloud`` they are put into this process's environment and the job is handed to
Horovod's runner (``horovod.runner.launch._run``, what horovodrun itself calls), which forwards the
launcher's environment to every rank: to local ranks directly, to remote ones on the ssh command
line (Gloo) or with ``mpirun -x`` (MPI). With ``--emulate-cloud`` the job goes to
``fasthorovod.runner.emulated``, which brings the emulated cloud up and runs this same command line,
minus ``--emulate-cloud`` (``horovodrun_argv``), from inside it.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from fasthorovod.config import ALIASES, MAX_LANES, MAX_SOCKETS_PER_LANE, PREFIX, Config, ConfigError
from fasthorovod import patch
from fasthorovod.netem import parse_spec
from fasthorovod.units import bytes_argument

PROG = "fasthorovodrun"

DESCRIPTION = (
    "FastHorovod runner: horovodrun (Horovod 0.28.1's own parser and runner, all its flags below) "
    "plus the FastHorovod arguments, which set FASTHOROVOD_* variables for every rank, and "
    "--emulate-cloud, which runs the job on an emulated public-cloud network on this machine."
)
EPILOG = (
    "Examples: fasthorovodrun --gloo -np 4 -H a:1,b:1,c:1,d:1 --lanes 8 python train.py;  "
    "fasthorovodrun --emulate-cloud 4:1gbit:200mbit -np 4 python train.py.  See docs/runner.md."
)

# The environment variable each FastHorovod flag sets (documented in docs/env.md).
FLAG_VARIABLES = {
    "lanes": PREFIX + "NUM_LANES",
    "sockets_per_lane": PREFIX + "SOCKETS_PER_LANE",
    "proxy_threshold": PREFIX + "PROXY_THRESHOLD_BYTES",
}

def _count(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high}]")
        return value

    return parse


def _cloud_spec(text: str):
    try:
        return parse_spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_fasthorovod_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "FastHorovod arguments",
        "Each sets a FASTHOROVOD_* variable (docs/env.md) in the environment of every rank; a flag "
        "overrides the variable inherited from the launcher's environment, under its name or its "
        "former one. They take effect in scripts that `import fasthorovod.torch as hvd`.")
    group.add_argument(
        "--lanes", "--proxies", type=_count(0, MAX_LANES), metavar="K",
        help="Lanes per worker (FASTHOROVOD_NUM_LANES): a lane is one proxy process, which carries "
             "one shard of every large allreduce over its own TCP connections, so a worker uses K "
             f"parallel flows and K cores. 0 sends everything through Horovod. 0-{MAX_LANES}; "
             "default 4, or more where the path probe measures a network faster than 4 lanes can "
             "carry and the workers have the cores. --proxies is its former name.")
    group.add_argument(
        "--sockets-per-lane", "--sockets-per-proxy", type=_count(1, MAX_SOCKETS_PER_LANE), metavar="S",
        help="TCP connections from each lane's proxy to its ring neighbour, frames striped over "
             "them (FASTHOROVOD_SOCKETS_PER_LANE); a worker then opens K*S flows to its neighbour. "
             f"1-{MAX_SOCKETS_PER_LANE}; default: measured at start-up when the ranks span hosts "
             "(the path probe), else 1. --sockets-per-proxy is its former name.")
    group.add_argument(
        "--proxy-threshold", type=bytes_argument, metavar="BYTES",
        help="Sum/Average allreduces of at least this many bytes go through the proxies, smaller "
             "ones through Horovod (FASTHOROVOD_PROXY_THRESHOLD_BYTES). A number of bytes or e.g. "
             "64KiB, 1MiB (KiB/MiB/GiB are 1024^n, kB/MB/GB 1000^n); default 1MiB, or 8MiB when every rank runs on one host (a value "
             "given here applies everywhere).")
    group.add_argument(
        "--patch-horovod", action="store_true",
        help="Ranks whose script imports horovod.torch itself get fasthorovod.torch (an opt-in "
             "switch for programs that cannot change their import: fasthorovod's patch directory "
             "goes first on PYTHONPATH; rank 0 says so on stderr; docs/runner.md).")
    group.add_argument(
        "--emulate-cloud", type=_cloud_spec, metavar="HOSTS:LINK:PER_FLOW",
        help="Run the job on an emulated public-cloud network on this machine, e.g. "
             "4:1gbit:200mbit: HOSTS network namespaces on a bridge, each host's link capped at "
             "LINK in both directions and every TCP connection at PER_FLOW (fasthorovod.netem, "
             "docs/netem.md), each running an sshd. The rest of the command line then runs as on a "
             "real cluster, from a launcher namespace that reaches the hosts as host0, host1, ...: "
             "Horovod's runner starts the ranks over ssh (--gloo, the default here, or --mpi), "
             "static or elastic. Without -H/--hostfile, -np N ranks go one per host (N/HOSTS per "
             "host when N is a multiple of HOSTS; on the first N hosts when N < HOSTS); an elastic "
             "job (--min-np/--max-np) without a discovery script gets the cloud's, which `python -m "
             "fasthorovod.netem host-down/host-up` change. The network is always torn down "
             "afterwards. Needs root and openssh-server. Hosts on slower "
             "paths (other racks or zones) are per-host overrides after commas: ,hostI=PER_FLOW sets "
             "host I's per-flow cap, ,hostI=LINK:PER_FLOW its link and per-flow cap (I counts from 0; "
             "host I runs ranks I*P..I*P+P-1 for P ranks per host), e.g. "
             "5:1gbit:200mbit,host1=100mbit,host3=500mbit:150mbit. A host's rates apply to what it "
             "sends and receives, so a flow gets the smaller per-flow cap of its two hosts.")


def _customize(parser: argparse.ArgumentParser) -> None:
    parser.prog = PROG
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    add_fasthorovod_arguments(parser)


def _parse_with_horovod(argv: Sequence[str]) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """Run Horovod's parse_args on ``argv`` with our group added to its parser (see module doc)."""
    from horovod.runner import launch as horovod_launch

    original = argparse.ArgumentParser.parse_args
    captured: dict[str, argparse.ArgumentParser] = {}

    def parse(parser: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        argparse.ArgumentParser.parse_args = original  # intercept exactly one call
        captured["parser"] = parser
        _customize(parser)
        return original(parser, list(argv), namespace)

    argparse.ArgumentParser.parse_args = parse  # type: ignore[method-assign]
    try:
        args = horovod_launch.parse_args()
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    if "parser" not in captured:  # a Horovod whose parse_args works differently
        raise RuntimeError("could not extend horovod.runner.launch.parse_args (Horovod 0.28.1 expected)")
    return args, captured["parser"]


def fasthorovod_env(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The FASTHOROVOD_* variables that the flags in ``args`` set (only those given).

    ``--patch-horovod`` puts fasthorovod's patch directory first on PYTHONPATH (fasthorovod/patch.py).
    Outside the emulated mode, a single ``--network-interfaces`` NIC also becomes FASTHOROVOD_IFACE
    (unless the environment sets it), so the proxies bind where Horovod's traffic goes under MPI
    too (under Gloo they already follow HOROVOD_GLOO_IFACE).
    """
    environ = os.environ if environ is None else environ
    env = {var: str(getattr(args, dest)) for dest, var in FLAG_VARIABLES.items()
           if getattr(args, dest, None) is not None}
    if getattr(args, "patch_horovod", False):
        env["PYTHONPATH"] = patch.with_patch(environ.get("PYTHONPATH"))
    nics = sorted(getattr(args, "nics", None) or [])
    if getattr(args, "emulate_cloud", None) is None and len(nics) == 1 and not environ.get(PREFIX + "IFACE"):
        env[PREFIX + "IFACE"] = nics[0]
    return env


def with_flags(environ: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the variables the flags set (``env``, from :func:`fasthorovod_env`) in
    place of what it held under their names or their former names (``config.ALIASES``): a flag
    overrides an inherited FASTHOROVOD_NUM_PROXIES as it overrides FASTHOROVOD_NUM_LANES, and the
    ranks must not see both with different values."""
    former = {ALIASES[variable] for variable in env if variable in ALIASES}
    return {**{k: v for k, v in environ.items() if k not in former}, **env}


def _emulated_conflicts(args: argparse.Namespace) -> list[str]:
    """Reasons why ``args`` cannot run with --emulate-cloud (empty when they can)."""
    spec = args.emulate_cloud
    problems = []
    if args.use_jsrun:
        problems.append("--jsrun is not supported (use --gloo or --mpi)")
    if args.nics and set(args.nics) != {"eth0"}:
        problems.append("--network-interfaces: an emulated host has one interface, eth0")
    elastic = args.host_discovery_script or args.min_num_proc or args.max_num_proc
    if args.hosts or args.hostfile or elastic:
        return problems  # the user's hosts (host0, host1, ...), or the cloud's discovery script
    if args.num_proc is None or args.num_proc < 1:
        problems.append("-np must be at least 1")
    elif args.num_proc > spec.hosts and args.num_proc % spec.hosts:
        problems.append(f"-np {args.num_proc} is not a multiple of the {spec.hosts} emulated hosts "
                        f"(ranks are spread evenly: -np {spec.hosts * (args.num_proc // spec.hosts)} "
                        f"or {spec.hosts * (args.num_proc // spec.hosts + 1)})")
    return problems


def _without_option(parser: argparse.ArgumentParser, argv: Sequence[str], command: Sequence[str],
                    dest: str) -> list[str]:
    """``argv`` without the option whose destination is ``dest`` and its value, however it was
    written (``--emulate-cloud X``, ``--emulate-cloud=X``, or an abbreviation argparse accepted);
    the command (the tail of argv) is kept whole."""
    options, tail = list(argv[: len(argv) - len(command)]), list(argv[len(argv) - len(command):])
    by_string = {string: action for action in parser._actions for string in action.option_strings}
    kept, index = [], 0
    while index < len(options):
        token = options[index]
        name, has_value, _ = token.partition("=")
        action = by_string.get(name)
        if action is None and name.startswith("--"):
            matches = {by_string[s] for s in by_string if s.startswith(name) and s.startswith("--")}
            action = matches.pop() if len(matches) == 1 else None
        if action is not None and action.dest == dest:
            index += 1 if has_value or action.nargs == 0 else 2
            continue
        kept.append(token)
        index += 1
    return kept + tail


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a fasthorovodrun command line (``sys.argv[1:]`` by default); exits on errors, like
    horovodrun. The result is Horovod's namespace plus ``lanes``, ``sockets_per_lane``,
    ``proxy_threshold`` (ints or None), ``emulate_cloud`` (a ``CloudSpec`` or None) and, with
    --emulate-cloud, ``horovodrun_argv``: the command line without it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, parser = _parse_with_horovod(argv)
    if not args.command:
        parser.error("no command to run given (e.g. python train.py)")
    try:
        Config.from_env(with_flags(os.environ, fasthorovod_env(args)))
    except ConfigError as err:
        parser.error(str(err))
    if args.emulate_cloud is not None:
        problems = _emulated_conflicts(args)
        if problems:
            parser.error("--emulate-cloud: " + "; ".join(problems))
        args.horovodrun_argv = _without_option(parser, argv, args.command, "emulate_cloud")
    return args


def _exit_code(err: BaseException) -> int:
    """Horovod's Gloo runner reports the first failed rank as 'Exit code: N'; use N."""
    match = re.search(r"[Ee]xit code:? (-?\d+)", str(err))
    code = int(match.group(1)) if match else 1
    return code if 0 < code < 256 else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.log_level:  # as horovodrun does
        logging.addLevelName(logging.NOTSET, "TRACE")
        logging.basicConfig(level=logging.getLevelName(args.log_level))
    env = fasthorovod_env(args)
    if args.emulate_cloud is not None:
        from .emulated import run_emulated

        return run_emulated(args, env)

    from horovod.runner import launch as horovod_launch

    # Horovod's runner hands the launcher's environment to every rank
    for variable in set(os.environ) - set(with_flags(os.environ, env)):
        del os.environ[variable]  # a former name the flags override
    os.environ.update(env)
    if args.verbose and env:
        print(f"{PROG}: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())), file=sys.stderr)
    try:
        horovod_launch._run(args)
    except (RuntimeError, ValueError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return _exit_code(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())

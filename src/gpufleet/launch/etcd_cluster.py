"""``gpufleet etcd``: one member of the etcd cluster that holds a run's stores.

With ``--rdzv-backend etcd`` no training node holds a store the others need (see
:mod:`gpufleet.launch.etcd_store`), so losing any one node, the one that started the
job included, is survived in process. The cluster needs a majority of its members: three
members survive the loss of one, five of two. Run one member on each of three hosts
(training nodes or not), the same ``--cluster`` on each:

    gpufleet etcd --name a --cluster a=10.0.0.1,b=10.0.0.2,c=10.0.0.3   # on 10.0.0.1
    gpufleet etcd --name b --cluster a=10.0.0.1,b=10.0.0.2,c=10.0.0.3   # on 10.0.0.2
    gpufleet etcd --name c --cluster a=10.0.0.1,b=10.0.0.2,c=10.0.0.3   # on 10.0.0.3
    gpufleet train --nnodes 1:4 --rdzv-backend etcd \\
        --rdzv-endpoint 10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379 --rdzv-id exp1 ...

The member is the etcd server itself (``etcd``, e.g. Debian's ``etcd-server``), run in
place of this process with its v2 API on (the one torch's etcd backends and
python-etcd speak); ``--print`` shows its command line instead. Only the standard
library is imported here, so building the CLI's parser stays fast.

Example:
    >>> parse_cluster("a=10.0.0.1,b=10.0.0.2")
    {'a': '10.0.0.1', 'b': '10.0.0.2'}
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys

from gpufleet.errors import LaunchError

CLIENT_PORT, PEER_PORT = 2379, 2380  # etcd's own defaults
#: The user-facing name of the backend (``--rdzv-backend etcd``).
BACKEND = "etcd"
#: The name gpufleet's rendezvous on etcd is registered under with torch (torch's own
#: "etcd" is its older rendezvous, on one endpoint).
TORCH_BACKEND = "gpufleet-etcd"
#: The environment variable that gives the ranks the cluster's endpoints (set by the
#: launcher; the agents pass it on to the ranks they start).
ENDPOINTS_ENV = "GPUFLEET_ETCD_ENDPOINTS"
_INSTALL = ("install etcd (Debian/Ubuntu: `apt-get install etcd-server`; elsewhere a release "
            "from github.com/etcd-io/etcd), or give its path with --etcd PATH")


def uses_etcd() -> bool:
    """Whether this rank's stores live on an etcd cluster (``--rdzv-backend etcd``)."""
    return bool(os.environ.get(ENDPOINTS_ENV))


def parse_cluster(text: str) -> dict[str, str]:
    """``"NAME=HOST,NAME=HOST,..."`` as ``{name: host}``.

    Raises:
        LaunchError: an entry without a name or a host, or a name given twice.
    """
    members: dict[str, str] = {}
    for entry in (e.strip() for e in text.split(",")):
        name, sep, host = entry.partition("=")
        if not (sep and name.strip() and host.strip()) or name.strip() in members:
            raise LaunchError(f"--cluster {text!r}: {entry!r} is not NAME=HOST (or names a "
                              "member twice). Give every member once, the same list on each: "
                              "a=10.0.0.1,b=10.0.0.2,c=10.0.0.3.")
        members[name.strip()] = host.strip()
    return members


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def member_command(name: str, cluster: dict[str, str], data_dir: str, *,
                   etcd: str = "etcd", client_port: int = CLIENT_PORT,
                   peer_port: int = PEER_PORT, token: str = "gpufleet") -> list[str]:
    """The etcd command line of member ``name`` of ``cluster`` ({name: host}).

    Raises:
        LaunchError: ``name`` is not a member of ``cluster``.

    Example:
        >>> member_command("a", {"a": "10.0.0.1"}, "/var/lib/etcd-a")[:3]
        ['etcd', '--name', 'a']
    """
    if name not in cluster:
        raise LaunchError(f"--name {name!r} is not a member of --cluster "
                          f"({', '.join(cluster)}). Give this host's own name from the list.")
    host = cluster[name]
    peers = ",".join(f"{n}={_url(h, peer_port)}" for n, h in cluster.items())
    return [etcd, "--name", name, "--data-dir", data_dir, "--enable-v2",
            "--listen-client-urls", _url(host, client_port),
            "--advertise-client-urls", _url(host, client_port),
            "--listen-peer-urls", _url(host, peer_port),
            "--initial-advertise-peer-urls", _url(host, peer_port),
            "--initial-cluster", peers, "--initial-cluster-state", "new",
            "--initial-cluster-token", token]


def endpoints(cluster: dict[str, str], client_port: int = CLIENT_PORT) -> str:
    """The ``--rdzv-endpoint`` of a cluster: every member's client address.

    Example:
        >>> endpoints({"a": "10.0.0.1", "b": "10.0.0.2"})
        '10.0.0.1:2379,10.0.0.2:2379'
    """
    return ",".join(f"[{h}]:{client_port}" if ":" in h else f"{h}:{client_port}"
                    for h in cluster.values())


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet etcd`` to the CLI's subparsers."""
    p = sub.add_parser(
        "etcd", help="run one member of an etcd cluster for --rdzv-backend etcd (no node "
                     "the run cannot lose)",
        description="Run one member of the etcd cluster that holds the stores of runs started "
                    "with --rdzv-backend etcd. Start it on every host of --cluster (three "
                    "survive losing one). The etcd server replaces this process.")
    p.add_argument("--name", required=True, help="this member's name in --cluster")
    p.add_argument("--cluster", required=True,
                   help="every member, NAME=HOST comma-separated, the same on each host")
    p.add_argument("--data-dir", default="",
                   help="where the member keeps its data (default: ./etcd-NAME)")
    p.add_argument("--client-port", type=int, default=CLIENT_PORT,
                   help=f"port the nodes reach the member at (default {CLIENT_PORT})")
    p.add_argument("--peer-port", type=int, default=PEER_PORT,
                   help=f"port the members talk to each other at (default {PEER_PORT})")
    p.add_argument("--etcd", default="etcd", help="the etcd server to run (default: etcd)")
    p.add_argument("--print", action="store_true", dest="print_only",
                   help="print the etcd command line instead of running it")


def run(args: argparse.Namespace) -> int:
    """Run the member (exec etcd), or print its command line."""
    try:
        cluster = parse_cluster(args.cluster)
        for flag, port in (("--client-port", args.client_port), ("--peer-port", args.peer_port)):
            if not 0 < port < 65536:
                raise LaunchError(f"{flag} {port} is not a TCP port. Give 1 to 65535.")
        argv = member_command(args.name, cluster, args.data_dir or f"etcd-{args.name}",
                              etcd=args.etcd, client_port=args.client_port,
                              peer_port=args.peer_port)
    except LaunchError as err:
        print(f"gpufleet: error: {err}", file=sys.stderr)
        return 2
    hint = (f"start every node with --rdzv-backend etcd --rdzv-endpoint "
            f"{endpoints(cluster, args.client_port)} --rdzv-id RUN_NAME")
    if args.print_only:
        print(shlex.join(argv))
        print(f"# then {hint}")
        return 0
    binary = shutil.which(args.etcd)
    if binary is None:
        print(f"gpufleet: error: no etcd server {args.etcd!r} here: {_INSTALL}.",
              file=sys.stderr)
        return 1
    print(f"gpufleet etcd: member {args.name!r} of {len(cluster)}; {hint}", flush=True)
    os.execv(binary, argv)  # etcd takes this process's place (and its signals)
    return 0  # not reached

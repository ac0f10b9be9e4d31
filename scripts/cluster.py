#!/usr/bin/env python3
"""A cluster of network namespaces on this machine, for trying multi-node gpufleet by hand.

    sudo python scripts/cluster.py up --nodes 2 --name demo     # prints each node's address
    sudo python scripts/cluster.py run demo 0 -- gpufleet train --nnodes 2 ...
    sudo python scripts/cluster.py link demo 1 down              # cut node 1 (up: restore)
    sudo python scripts/cluster.py rate demo 1 20                # 20 Mbit/s; `off` clears
    sudo python scripts/cluster.py kill demo 1                   # kill -9 all of node 1
    sudo python scripts/cluster.py list
    sudo python scripts/cluster.py down demo                     # remove it all

The host's network is never touched: the bridge lives in a namespace of its own.
"""

from __future__ import annotations

import argparse
import os
import sys

from gpufleet.bench.netbed import NetBed, beds, netbed_available, remove_bed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a bed and leave it up")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--name", default="gfbed", help="prefix of its namespaces")
    sub.add_parser("list", help="the beds on this machine")
    for name, helptext in (("down", "remove a bed"), ("run", "run a command on a node"),
                           ("link", "set a node's link down or up"),
                           ("rate", "limit a node's link (Mbit/s, or off)"),
                           ("kill", "kill -9 every process on a node")):
        cmd = sub.add_parser(name, help=helptext)
        cmd.add_argument("name")
        if name != "down":
            cmd.add_argument("node", type=int)
    sub.choices["link"].add_argument("state", choices=("down", "up"))
    sub.choices["rate"].add_argument("mbit")
    sub.choices["run"].add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    reason = netbed_available()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    if args.cmd == "up":
        if args.name in beds():
            print(f"error: a bed named {args.name!r} is up already; "
                  f"`cluster.py down {args.name}` first, or pick another --name.",
                  file=sys.stderr)
            return 2
        bed = NetBed(args.nodes, name_prefix=args.name)
        bed.detach()
        for i in range(bed.nodes):
            print(f"node {i}: namespace {bed.ns(i)}, address {bed.addr(i)}")
        return 0
    if args.cmd == "list":
        for name in sorted(beds()):
            bed = NetBed.attach(name)
            print(f"{name}: {bed.nodes} node(s), " +
                  ", ".join(bed.addr(i) for i in range(bed.nodes)))
        return 0
    if args.cmd == "down":
        remove_bed(args.name)
        return 0
    bed = NetBed.attach(args.name)
    if args.cmd == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("run: give a command after --")
        os.execvp("ip", ["ip", "netns", "exec", bed.ns(args.node), *command])
    if args.cmd == "link":
        (bed.link_down if args.state == "down" else bed.link_up)(args.node)
    elif args.cmd == "rate":
        bed.rate_limit(args.node, None if args.mbit == "off" else float(args.mbit))
    elif args.cmd == "kill":
        print(f"killed {len(bed.kill_node(args.node))} process(es) on node {args.node}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`rlstream twin`: bring a cluster twin up by hand, run commands on its hosts, take it down.

    rlstream twin up --prefix rehearse --host broker --host trainer-0 --host producer-0 \\
        --host producer-1 --rate-mbit 1000
    rlstream twin exec --prefix rehearse trainer-0 -- rlstream consumer -c my.yaml
    rlstream twin down --prefix rehearse

`up` leaves the namespaces in place (the twin of a test removes its own); the
hosts' addresses and the hosts file every host sees are printed. Needs root.
"""
from __future__ import annotations

import argparse
import os
import sys

from rlstream.cluster.twin import ClusterTwin, Host, remove, unavailable_reason


def add_parser(sub) -> None:
    t = sub.add_parser("twin", help="a cluster on this machine: hosts as network namespaces (needs root)")
    actions = t.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="create the hosts (they stay until `down`)")
    up.add_argument("--host", action="append", default=[], dest="hosts", required=True,
                    help="a host: NAME or NAME=ALIAS,ALIAS (repeat)")
    up.add_argument("--rate-mbit", type=float, help="every NIC's bandwidth each way (default unshaped)")
    up.add_argument("--delay-ms", type=float, default=0.0, help="latency at every NIC (needs sch_netem)")
    down = actions.add_parser("down", help="remove every host of the twin")
    ex = actions.add_parser("exec", help="run a command on one host: exec HOST -- COMMAND ...")
    ex.add_argument("host")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    for p in (up, down, ex):
        p.add_argument("--prefix", default="rlstream", help="namespace names are PREFIX-HOST (default rlstream)")


def _hosts(specs: list[str], rate: float | None, delay: float) -> list[Host]:
    out = []
    for spec in specs:
        name, _, aliases = spec.partition("=")
        out.append(Host(name, rate, delay, tuple(a for a in aliases.split(",") if a)))
    return out


def run_twin(args: argparse.Namespace) -> int:
    if args.action == "down":
        print("removed:", " ".join(remove(args.prefix)) or "nothing")
        return 0
    why = unavailable_reason()
    if why:
        print(f"rlstream twin: cannot build a twin here: {why}", file=sys.stderr)
        return 2
    if args.action == "up":
        twin = ClusterTwin(_hosts(args.hosts, args.rate_mbit, args.delay_ms), prefix=args.prefix).up()
        for h in twin.hosts:
            s = twin.shaping[h.name]
            print(f"{twin.ns(h.name)}  {twin.address(h.name)}  rate={s.rate_mbit} Mbit/s delay={s.delay_ms} ms {s.note}")
        print(f"hosts file (every host):\n{twin.hosts_file()}", end="")
        return 0
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("rlstream twin exec: HOST -- COMMAND ...", file=sys.stderr)
        return 2
    twin = ClusterTwin([Host(args.host)], prefix=args.prefix)  # names only: the namespace exists
    os.execvp(twin.command(args.host, argv)[0], twin.command(args.host, argv))

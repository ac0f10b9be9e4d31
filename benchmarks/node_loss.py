"""What losing a node costs an elastic run: seconds of progress lost and steps repeated.

Builds a 2-node network bed (gpufleet.bench.netbed; needs root) and starts the built-in
GPT (n_embd 96, 2 layers) on both nodes as an elastic ``--nnodes 1:2 --max-restarts 3``
run with a checkpoint every ``--every`` steps. Once both train past step ``--kill-at``
(by default 2 steps after a checkpoint), every process of node 1 is killed (SIGKILL).
Node 0 goes on alone from the newest checkpoint; ``--rejoin-after`` seconds after the
kill node 1 is started again and rejoins; then the run is stopped. From node 0's
metrics.jsonl:

* recovery: seconds from the kill to node 0's first step trained alone;
* steps repeated: steps done before the kill that came after the checkpoint resumed from;
* lost progress: seconds from the kill until the run is back at the step it had reached;
* rejoin: seconds from node 1's restart to the first step with both nodes again.

With ``--snapshot-every N`` every rank keeps an in-memory snapshot every N steps and node
0 goes on in its own process from its newest one (no restart, no checkpoint read);
``in_process`` says whether it did (1) or fell back to the agent's restart (0).

    sudo python benchmarks/node_loss.py                 # about 2 minutes a repeat
    sudo python benchmarks/node_loss.py --snapshot-every 1   # recovery in process
    sudo python benchmarks/node_loss.py --snapshot-every 1 --strategy fsdp   # shards too
    sudo python benchmarks/node_loss.py --lose-store    # node 0, the store's host, lost

``--lose-store`` kills node 0 instead, the node whose agent hosts the rendezvous store
(``--rdzv-endpoint`` points at it): it measures what the survivor does then, whether it
trains alone, and how long until its launcher exits, with the last lines it printed.

``--store-host separate`` runs the store off the training nodes: a third node of the bed
serves it (``gpufleet store``) and every training node is its client. Node 0 is then the
node killed, a node like any other: recovery, steps repeated, lost progress and node
0's rejoin are measured as above, node 1 the survivor. With ``--lose-store`` too, the
store's own node is killed and both training nodes are watched.

    sudo python benchmarks/node_loss.py --store-host separate --repeats 3
    sudo python benchmarks/node_loss.py --store-host separate --lose-store

``--store-host etcd`` keeps every store on a 3-member etcd cluster (``gpufleet etcd``),
one member on each of three nodes of the bed, two of them training (``--rdzv-backend
etcd``). Node 0, the node that started the job and whose rank was rank 0, is killed
(its member with it); node 1 the survivor; node 0 (its member first) started again
``--rejoin-after`` s later. With ``--lose-store`` node 2, the node that holds only a
member, is killed instead: the two training nodes should go on together, at world 2,
and the row says how many steps they trained in the ``--watch`` seconds after.

    sudo python benchmarks/node_loss.py --store-host etcd --snapshot-every 1
    sudo python benchmarks/node_loss.py --store-host etcd --lose-store --snapshot-every 1
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from gpufleet.bench.netbed import NetBed, netbed_available
from gpufleet.bench.runs import small_gpt_job
from gpufleet.core.machine import machine_summary


def records(run_dir: Path) -> list[dict]:
    path, out = run_dir / "metrics.jsonl", []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "train":
            out.append(record)
    return out


def wait_until(test, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = test()
        if found:
            return found
        time.sleep(0.1)
    sys.exit(f"gave up after {timeout:.0f} s")


def elastic_job(bed: NetBed, run_dir: Path, args: argparse.Namespace) -> list[str]:
    """The 1:2-node elastic command every node runs, the store on node 0."""
    return [*small_gpt_job(args.steps, n_embd=96, n_layer=2), "--log.every", "1",
            "--strategy", args.strategy, "--checkpoint.every", str(args.every), "--run-dir",
            str(run_dir), "--nproc", "1", "--nnodes", "1:2", "--rdzv-endpoint",
            f"{bed.addr(0)}:29400", "--rdzv-id", run_dir.name, "--max-restarts", "3",
            "--dist.rdzv_last_call_s", "2", "--dist.rdzv_keep_alive_s", "1",
            "--fault.snapshot_every", str(args.snapshot_every),
            "--dist.rdzv_poll_s", str(args.rdzv_poll)]


def one_loss(bed: NetBed, run_dir: Path, args: argparse.Namespace, *, lose: int = 1,
             endpoint: str | None = None, etcd: bool = False) -> dict[str, float]:
    """Both nodes train; every process of node ``lose`` is killed, and started again
    ``--rejoin-after`` s after the kill. ``endpoint``: a store elsewhere (default: in
    node 0's launcher); ``etcd``: a member of the etcd cluster runs on every node, and
    the lost node's is started again first."""
    job = elastic_job(bed, run_dir, args)
    if etcd:
        endpoint = start_etcd(bed, run_dir.parent / f"{run_dir.name}-etcd")
        job = [*job, "--rdzv-backend", "etcd"]
    if endpoint:
        job = with_endpoint(job, endpoint)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    survivor = 1 - lose
    said = run_dir.parent / f"{run_dir.name}-node{survivor}.log"
    for node in (0, 1):
        if node == survivor:
            with open(said, "w") as out:  # which path the survivor took
                bed.popen(node, job, env=env, stdout=out, stderr=subprocess.STDOUT)
        else:
            bed.popen(node, job, env=env, **quiet)
        time.sleep(0.5)
    wait_until(lambda: [r for r in records(run_dir)
                        if r["step"] >= args.kill_at and len(r["rank_phases"]) == 2], 300)
    before = records(run_dir)
    killed_at = time.time()
    bed.kill_node(lose)
    alone = wait_until(lambda: [r for r in records(run_dir)[len(before):]
                                if len(r["rank_phases"]) == 1], 120)
    # The step reached at the kill: the newest with both nodes (one may have ended
    # between reading the records above and the kill).
    at_step = max(r["step"] for r in records(run_dir) if len(r["rank_phases"]) == 2)
    time.sleep(max(0.0, killed_at + args.rejoin_after - time.time()))
    if etcd:  # its member back first (from its data folder), as an operator would
        start_member(bed, lose, run_dir.parent / f"{run_dir.name}-etcd")
        wait_healthy(bed, list(range(bed.nodes)))
    rejoined_at = time.time()
    with open(run_dir.parent / f"{run_dir.name}-node{lose}-restart.log", "w") as out:
        bed.popen(lose, job, env=env, stdout=out, stderr=subprocess.STDOUT)
    seen = len(records(run_dir))
    both = wait_until(lambda: [r for r in records(run_dir)[seen:]
                               if len(r["rank_phases"]) == 2], 300)
    # Measured: the bed's teardown ends the run (it is long so that it outlasts the rejoin).
    back = next(r for r in records(run_dir)[len(before):] if r["step"] >= at_step)
    return {"recovery_s": alone[0]["time"] - killed_at,
            "repeated": at_step - (alone[0]["step"] - 1),
            "lost_s": back["time"] - killed_at,
            "rejoin_s": both[0]["time"] - rejoined_at,
            "in_process": float("recovered in-process" in said.read_text(errors="replace"))}


def store_loss(bed: NetBed, run_dir: Path, args: argparse.Namespace,
               limit: float = 240.0) -> dict[str, object]:
    """Both nodes train; every process of the store's host is killed: node 0 (the store
    in its launcher), or with ``--store-host separate`` the third node that runs
    ``gpufleet store``. The training nodes left are watched for ``limit`` seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = elastic_job(bed, run_dir, args)
    host = 2 if args.store_host == "separate" else 0
    if host == 2:
        job = with_endpoint(job, start_store(bed, 2, env, run_dir.parent / "store.log"))
    left = [n for n in (0, 1) if n != host]
    procs, logs = {}, {n: run_dir.parent / f"{run_dir.name}-node{n}.log" for n in (0, 1)}
    for n in (0, 1):
        with open(logs[n], "w") as out:
            procs[n] = bed.popen(n, job, env=env, stdout=out, stderr=subprocess.STDOUT)
        time.sleep(0.5)  # node 0 first: with the store in its launcher, it must listen
    wait_until(lambda: [r for r in records(run_dir)
                        if r["step"] >= args.kill_at and len(r["rank_phases"]) == 2], 300)
    seen = len(records(run_dir))
    killed_at = time.time()
    bed.kill_node(host)
    row: dict[str, object] = {"host": host}
    for n in left:
        try:
            code = procs[n].wait(timeout=max(1.0, killed_at + limit - time.time()))
            row[f"exit_s{n}"], row[f"code{n}"] = time.time() - killed_at, code
        except subprocess.TimeoutExpired:
            row[f"exit_s{n}"], row[f"code{n}"] = float("inf"), None
        tail = [line for line in logs[n].read_text(errors="replace").splitlines()
                if line.strip()]
        row[f"last_lines{n}"] = tail[-4:]
    row["trained_alone"] = any(len(r["rank_phases"]) == 1 for r in records(run_dir)[seen:])
    return row


STORE_PORT = 29400


def start_store(bed: NetBed, node: int, env: dict[str, str], log: Path) -> str:
    """``gpufleet store`` on ``node`` of the bed (output to ``log``); its endpoint once it
    listens."""
    with open(log, "w") as out:
        bed.popen(node, [sys.executable, "-m", "gpufleet", "store", "--port",
                         str(STORE_PORT)], env=env, stdout=out, stderr=subprocess.STDOUT)
    wait_until(lambda: "listening on port" in log.read_text(errors="replace"), 60)
    return f"{bed.addr(node)}:{STORE_PORT}"


def start_member(bed: NetBed, node: int, folder: Path) -> None:
    """Member ``m<node>`` of the bed's etcd cluster (one on every node) on ``node``."""
    cluster = ",".join(f"m{i}={bed.addr(i)}" for i in range(bed.nodes))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"m{node}.log", "a") as out:
        bed.popen(node, [sys.executable, "-m", "gpufleet", "etcd", "--name", f"m{node}",
                         "--cluster", cluster, "--data-dir", str(folder / f"m{node}")],
                  stdout=out, stderr=subprocess.STDOUT)


def wait_healthy(bed: NetBed, members: list[int], timeout: float = 60.0) -> None:
    """Until every member of ``members`` answers, part of a healthy cluster."""
    urls = ",".join(f"{bed.addr(i)}:2379" for i in members)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        probe = bed.popen(members[0], ["etcdctl", "--endpoints", urls, "endpoint", "health"],
                          env={**os.environ, "ETCDCTL_API": "3"},
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if probe.wait(timeout=60) == 0:
            return
        time.sleep(0.3)
    sys.exit(f"the etcd cluster on {urls} did not become healthy in {timeout:.0f} s")


def start_etcd(bed: NetBed, folder: Path) -> str:
    """An etcd member on every node of the bed (``gpufleet etcd``); the endpoints."""
    for node in range(bed.nodes):
        start_member(bed, node, folder)
    wait_healthy(bed, list(range(bed.nodes)))
    return ",".join(f"{bed.addr(i)}:2379" for i in range(bed.nodes))


def member_loss(bed: NetBed, run_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """Both nodes train on the etcd cluster; node 2 (a member only) is killed; the steps
    trained in the ``--watch`` seconds after, and whether the world stayed 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = with_endpoint([*elastic_job(bed, run_dir, args), "--rdzv-backend", "etcd"],
                        start_etcd(bed, run_dir.parent / f"{run_dir.name}-etcd"))
    for node in (0, 1):
        with open(run_dir.parent / f"{run_dir.name}-node{node}.log", "w") as out:
            bed.popen(node, job, env=env, stdout=out, stderr=subprocess.STDOUT)
    wait_until(lambda: [r for r in records(run_dir)
                        if r["step"] >= args.kill_at and len(r["rank_phases"]) == 2], 300)
    at_step = records(run_dir)[-1]["step"]
    killed_at = time.time()
    bed.kill_node(2)
    time.sleep(args.watch)
    after = [r for r in records(run_dir) if r["time"] > killed_at]
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(after)]
    return {"steps_after": float(after[-1]["step"] - at_step) if after else 0.0,
            "world_2": float(bool(after) and all(len(r["rank_phases"]) == 2 for r in after)),
            "longest_gap_s": max(gaps, default=float("inf"))}


def with_endpoint(job: list[str], endpoint: str) -> list[str]:
    """``job`` with its ``--rdzv-endpoint`` replaced."""
    at = job.index("--rdzv-endpoint") + 1
    return [*job[:at], endpoint, *job[at + 1:]]


def separate_store_loss(bed: NetBed, run_dir: Path,
                        args: argparse.Namespace) -> dict[str, float]:
    """The store on node 2 (a third namespace, no training); every process of node 0
    killed; node 1 the survivor; node 0 started again ``--rejoin-after`` s later."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    store = start_store(bed, 2, env, run_dir.parent / f"{run_dir.name}-store.log")
    return one_loss(bed, run_dir, args, lose=0, endpoint=store)


def separate_store_rows(args: argparse.Namespace) -> None:
    """Each repeat, on fresh beds: today's layout (the store in node 0's launcher, node 1
    killed) as the reference, then the store on a third node with node 0 killed."""
    print("each repeat: reference = store in node 0's launcher, node 1 killed; separate = "
          "store on a third node (`gpufleet store`), node 0 killed and started again",
          flush=True)
    rows: dict[str, list[dict[str, float]]] = {"reference": [], "separate": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            with NetBed(2) as bed:
                rows["reference"].append(one_loss(bed, Path(tmp) / f"ref{i}", args))
            with NetBed(3) as bed:
                rows["separate"].append(separate_store_loss(bed, Path(tmp) / f"sep{i}", args))
            for name, done in rows.items():
                print(f"  repeat {i + 1} {name}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in done[-1].items()), flush=True)
    median = {name: {k: statistics.median(r[k] for r in done) for k in done[0]}
              for name, done in rows.items()}
    for name, values in median.items():
        print(f"median {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in values.items()))
    print("separate / reference: " + ", ".join(
        f"{k} {median['separate'][k] / median['reference'][k]:.2f}x"
        for k in median["reference"] if median["reference"][k]))


def etcd_rows(args: argparse.Namespace) -> None:
    """Each repeat on a fresh 3-node bed with an etcd member on every node: node 0 lost
    (or, with ``--lose-store``, node 2, a member only)."""
    what = "node 2 (an etcd member only) killed" if args.lose_store else \
        "node 0 (the node that started the job, an etcd member too) killed and started again"
    print(f"every store on a 3-member etcd cluster, a member on each node; {what}",
          flush=True)
    rows = []
    with workdir(args.keep) as tmp:
        for i in range(args.repeats):
            with NetBed(3) as bed:
                run_dir = Path(tmp) / f"etcd{i}"
                rows.append(member_loss(bed, run_dir, args) if args.lose_store else
                            one_loss(bed, run_dir, args, lose=0, etcd=True))
            print(f"  repeat {i + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[-1].items()),
                  flush=True)
    print("median: " + ", ".join(f"{k} {statistics.median(r[k] for r in rows):.1f}"
                                 for k in rows[0]))


@contextlib.contextmanager
def workdir(keep: str) -> Iterator[str]:
    """Where the runs go: ``keep`` (made if missing, left afterwards), else a temporary
    directory."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield tmp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rejoin-after", type=float, default=25.0)
    parser.add_argument("--kill-at", type=int, default=22)
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp", "hsdp"))
    parser.add_argument("--snapshot-every", type=int, default=0,
                        help="fault.snapshot_every: the survivor recovers in process from "
                             "its in-memory snapshot (0: off, the agent restarts it)")
    parser.add_argument("--rdzv-poll", type=float, default=0.0,
                        help="dist.rdzv_poll_s: seconds between the agents' reads of the "
                             "rendezvous state (1: torch's own; 0: gpufleet's default, "
                             "0.1 s for these 2 nodes)")
    parser.add_argument("--keep", metavar="DIR", default="",
                        help="keep the run directories and node logs under DIR (the "
                             "restarted node's log shows where its rejoin time goes)")
    parser.add_argument("--lose-store", action="store_true",
                        help="kill node 0 (the rendezvous store's host) instead of node 1")
    parser.add_argument("--store-host", choices=("node0", "separate", "etcd"), default="node0",
                        help="where the rendezvous store runs: node0 (in node 0's launcher), "
                             "separate (`gpufleet store` on a third node; node 0 is the "
                             "node killed, or with --lose-store the store's node) or etcd "
                             "(a 3-member etcd cluster, a member on each node; node 0 "
                             "killed, or with --lose-store node 2, a member only)")
    parser.add_argument("--watch", type=float, default=20.0,
                        help="--store-host etcd --lose-store: seconds the training nodes "
                             "are watched after the member's node is killed")
    args = parser.parse_args()
    reason = netbed_available()
    if reason:
        sys.exit(f"cannot run: {reason}")
    print(machine_summary())
    print(f"elastic 1:2 nodes, 1 rank each, {args.strategy}, checkpoint every {args.every} "
          f"steps, snapshot every {args.snapshot_every or '-'} steps, rendezvous heartbeat "
          f"1 s, last call 2 s, state read every {args.rdzv_poll or 'default'} s; killed "
          f"past step {args.kill_at}")
    if args.store_host == "etcd":
        etcd_rows(args)
        return
    if args.lose_store:
        where = "a third node (`gpufleet store`)" if args.store_host == "separate" else \
            "node 0's launcher"
        print(f"the store in {where}; every process of its host killed", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeats):
                with NetBed(3 if args.store_host == "separate" else 2) as bed:
                    row = store_loss(bed, Path(tmp) / f"store{i}", args)
                print(f"  repeat {i + 1}: node {row['host']} (store host) killed; a node "
                      f"trained alone: {row['trained_alone']}", flush=True)
                for n in (0, 1):
                    if f"code{n}" in row:
                        print(f"    node {n}'s launcher exited after {row[f'exit_s{n}']:.1f} s "
                              f"with code {row[f'code{n}']}; last lines:")
                        for line in row[f"last_lines{n}"]:  # type: ignore[attr-defined]
                            print(f"      {line[:300]}")
        return
    if args.store_host == "separate":
        separate_store_rows(args)
        return
    rows = []
    with workdir(args.keep) as tmp:
        for i in range(args.repeats):
            with NetBed(2) as bed:
                rows.append(one_loss(bed, Path(tmp) / f"loss{i}", args))
            print(f"  repeat {i + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[-1].items()),
                  flush=True)
    print("median: " + ", ".join(f"{k} {statistics.median(r[k] for r in rows):.1f}"
                                 for k in rows[0]))


if __name__ == "__main__":
    main()

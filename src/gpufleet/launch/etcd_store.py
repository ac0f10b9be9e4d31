"""The run's stores on an etcd cluster: no training node holds a store the others need.

With ``--rdzv-backend etcd --rdzv-endpoint HOST1:2379,HOST2:2379,HOST3:2379`` every
store a run uses lives in a replicated etcd cluster (its v2 API, ``etcd
--enable-v2``), reached through any member that answers:

* the agents' rendezvous: torch's own dynamic rendezvous and its etcd state backend
  (``EtcdRendezvousBackend``), given a client of every member instead of torch's one
  endpoint (registered with torch as :data:`TORCH_BACKEND`);
* the ranks' store (:func:`ranks_store`): the process group meets in it instead of in a
  ``TCPStore`` that rank 0 would host, and so do the watchdog's heartbeats, the
  membership of an in-process recovery, the snapshot ring's new group, the groups made
  after a recovery (prefixes of the same store) and a node that joins the live ranks.

Losing any one node, the one that started the job included, then loses no store: the
survivors go on in their processes. The cluster survives losing a minority of its
members (one of three). The client is ``python-etcd`` (``pip install
'gpufleet[etcd]'``), the one torch's etcd backends use. Importing it takes seconds on a
busy machine: this module is imported only where etcd is used (the names other modules
test for are in :mod:`.etcd_cluster`).

Example:
    >>> parse_endpoints("10.0.0.1:2379,10.0.0.2")
    [('10.0.0.1', 2379), ('10.0.0.2', 2379)]
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

from gpufleet.errors import LaunchError
from gpufleet.launch.etcd_cluster import ENDPOINTS_ENV, TORCH_BACKEND
from gpufleet.launch.netif import split_endpoint

try:
    import etcd

    from gpufleet.launch.etcd_client import FailoverClient
except ModuleNotFoundError:  # optional: a clear error when the backend is asked for
    etcd = FailoverClient = None

logger = logging.getLogger(__name__)
# python-etcd logs an error for every request a lost member fails, which the client then
# sends to another member: a survived loss, not an error of the run's. What the run
# cannot survive (no member left) reaches the run as an exception.
logging.getLogger("etcd.client").setLevel(logging.CRITICAL)

DEFAULT_PORT = 2379
_INSTALL = "pip install 'gpufleet[etcd]' (python-etcd, the client torch's etcd backends use)"
_RENDEZVOUS_KEYS, _AGENT_KEYS, _RANK_KEYS = "/gpufleet/rdzv", "/gpufleet/agents", "/gpufleet/ranks"
# Seconds one request to a member may take before the client tries the next member.
_READ_TIMEOUT_S = 5
# Seconds a request goes on trying the members before it fails: a new leader's election
# takes a second or two, even on a loaded machine; no member answering for longer is a
# lost majority, which the run cannot survive.
_FAILOVER_S = 30
# Every store made here, for the life of the process: a store written in Python lives
# only as long as its Python object, and torch's C++ side (a PrefixStore over it, the
# process group) holds no Python reference to it.
_KEPT: list[Any] = []


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``"HOST[:PORT],HOST[:PORT],..."`` as ``[(host, port), ...]`` (port 2379 when left out).

    Raises:
        LaunchError: an empty list or a bad entry, named, with the form expected.
    """
    found = []
    for part in (p.strip() for p in text.split(",")):
        host, port = split_endpoint(part) if part else ("", 0)
        if not host or not 0 <= port < 65536:
            raise LaunchError(f"--rdzv-endpoint {text!r}: {part!r} is not an etcd member's "
                              "address. Give every member's client address, comma-separated: "
                              "HOST1:2379,HOST2:2379,HOST3:2379.")
        found.append((host, port or DEFAULT_PORT))
    return found


def client(endpoints: str, timeout_s: float = _READ_TIMEOUT_S,
           failover_s: float = _FAILOVER_S) -> Any:
    """A python-etcd client of the cluster at ``endpoints`` that goes on through another
    member when the one it uses stops answering (a
    :class:`~gpufleet.launch.etcd_client.FailoverClient`: threads may share it).

    Raises:
        LaunchError: python-etcd is not installed, or no member answers.
    """
    if etcd is None:
        raise LaunchError(f"--rdzv-backend etcd needs the python-etcd client: {_INSTALL}.")
    hosts = tuple(parse_endpoints(endpoints))
    try:
        return FailoverClient(hosts, read_timeout=timeout_s, failover_s=failover_s)
    except etcd.EtcdException as err:
        raise LaunchError(
            f"No etcd member answers at {endpoints} ({err}). Start the cluster first (`gpufleet "
            "etcd --name NAME --cluster NAME1=HOST1,NAME2=HOST2,NAME3=HOST3` on each member's "
            "host, see docs/across-nodes.md), or fix --rdzv-endpoint.") from None


class EtcdKV(EtcdStore):
    """torch's c10d store on etcd (``EtcdStore``), with what gpufleet's code asks of a
    store besides: ``compare_set``, and reads of one key (torch's reads its whole
    folder for every key, which grows with the process groups made in it).

    Args:
        etcd_client: A python-etcd client (:func:`client`).
        prefix: The folder of the store's keys.
        timeout: How long ``get`` and ``wait`` wait for a key.
    """

    def __init__(self, etcd_client: Any, prefix: str,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=300)) -> None:
        super().__init__(etcd_client, prefix, timeout)
        _KEPT.append(self)
        #: (host, port) of every member: the connections a rank keeps when it cuts off
        #: a lost node (gpufleet.train.recovery.disconnect)
        self.endpoints = [split_endpoint(u.split("://")[-1]) for u in etcd_client.member_urls]

    def get(self, key: str | bytes) -> bytes:
        """The value of ``key``, once it is there (at most the store's timeout)."""
        name = self.prefix + self._encode(key)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            try:
                return self._decode(self.client.read(name, quorum=True).value)
            except etcd.EtcdKeyNotFound as missing:
                seen = (getattr(missing, "payload", None) or {}).get("index")
            left = deadline - time.monotonic()
            if left <= 0:
                raise LookupError(f"key {key!r} not in the etcd store after "
                                  f"{self.timeout.total_seconds():g} s")
            try:  # until it is written after the read that missed it (at most a second)
                self.client.watch(name, index=None if seen is None else seen + 1,
                                  timeout=min(left, 1.0))
            except (etcd.EtcdWatchTimedOut, etcd.EtcdKeyNotFound, etcd.EtcdConnectionFailed,
                    etcd.EtcdEventIndexCleared):
                pass

    def check(self, keys: list) -> bool:
        """Whether every key of ``keys`` is there now (as the cluster's leader knows)."""
        try:
            for key in keys:
                self.client.read(self.prefix + self._encode(key), quorum=True)
        except etcd.EtcdKeyNotFound:
            return False
        return True

    def add(self, key: str | bytes, num: int) -> int:
        """Add ``num`` to the number at ``key`` (0 when missing) and return it; ``add(key,
        0)``, the store's atomic read, reads without writing (torch's writes)."""
        if num != 0:
            return super().add(key, num)
        try:
            return int(self._decode(self.client.read(self.prefix + self._encode(key),
                                                     quorum=True).value))
        except etcd.EtcdKeyNotFound:
            return 0

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is missing and
        ``expected`` is empty), as ``TCPStore.compare_set``; returns the value it holds
        afterwards."""
        name = self.prefix + self._encode(key)
        try:
            if expected in ("", b""):
                node = self.client.write(name, self._encode(desired), prevExist=False)
            else:
                node = self.client.test_and_set(name, self._encode(desired),
                                                self._encode(expected))
            return self._decode(node.value)
        except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
            try:
                return self._decode(self.client.read(name).value)
            except etcd.EtcdKeyNotFound:
                return b"" if isinstance(expected, bytes) else expected.encode()


def ranks_store(address: tuple[str, int], timeout_s: float,
                run_id: str | None = None) -> dist.Store:
    """The ranks' store on the cluster named by :data:`ENDPOINTS_ENV`: their keys under
    the run's id and ``address``, the (host, port) the agents gave the ranks' rank 0
    for its store (MASTER_ADDR, MASTER_PORT: new at every round of the rendezvous), so
    that the ranks of one round, and a node that joins them later, meet in the same
    keys, and the next round in new ones. No process listens at ``address``.
    """
    endpoints = os.environ.get(ENDPOINTS_ENV, "")
    if not endpoints:
        raise LaunchError(f"{ENDPOINTS_ENV} is not set: the ranks' store on etcd needs the "
                          "cluster's endpoints (the launcher sets it for --rdzv-backend etcd).")
    run_id = run_id or os.environ.get("TORCHELASTIC_RUN_ID", "gpufleet")
    host, port = address
    # The address in the folder, not in a PrefixStore: code that reads the store's own
    # keys beneath the process groups' prefixes (gpufleet.train.recovery.growing) unwraps those.
    return EtcdKV(client(endpoints), f"{_RANK_KEYS}/{run_id}/{host}:{port}",
                  datetime.timedelta(seconds=timeout_s))


def register_rendezvous() -> None:
    """Register the agents' rendezvous on etcd with torch (:data:`TORCH_BACKEND`)."""
    rendezvous_handler_registry.register(TORCH_BACKEND, _create_handler)


def _create_handler(params: RendezvousParameters) -> Any:
    """torch's dynamic rendezvous on its etcd state backend, over every member."""
    # Deferred: torch's backend module imports python-etcd (checked by client()).
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import (
        EtcdRendezvousBackend,
    )

    class Backend(EtcdRendezvousBackend):
        @property
        def name(self) -> str:  # the name torch's registry checks the handler by
            return TORCH_BACKEND

    etcd_client = client(params.endpoint)
    backend = Backend(etcd_client, params.run_id, key_prefix=_RENDEZVOUS_KEYS)
    store = EtcdKV(etcd_client, f"{_AGENT_KEYS}/{params.run_id}")
    logger.info("rendezvous %r on the etcd cluster at %s", params.run_id, params.endpoint)
    return create_handler(store, backend, params)

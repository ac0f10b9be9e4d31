"""A client of every member of an etcd cluster that goes on through another member when
the one it uses is lost: python-etcd's client, with a failover of its own.

python-etcd fails over by itself (``allow_reconnect``), but not in a way a run can
lean on when it loses a node:

* its list of members to try shrinks with every failed request and is shared by the
  threads using one client (the training thread, the watchdog's heartbeats, torch's
  rendezvous keep-alive): threads that fail over at once empty it, and a request then
  ends with "No more machines in the cluster" while two members answer;
* after the loss of the member that was the cluster's leader, a request the others
  receive before they elect a new leader is dropped by etcd (its v2 API answers it
  only when the server's own request timeout, about 7 s, runs out): the client waits
  out its read timeout, then tries the next member.

Here every request goes to the member in use; when that member does not answer, the
request moves the client on to the next member of the fixed list (once for all the
threads), waits until the member it moved to knows a leader other than the lost member
(``/v2/stats/self``, which the member answers itself, at once), and is sent again. It
fails only when no member answered for ``failover_s``. python-etcd is imported by
whoever builds a client (:func:`gpufleet.launch.etcd_store.client`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.client import HTTPException
from typing import Any

import etcd
from urllib3.exceptions import HTTPError, ReadTimeoutError

logger = logging.getLogger(__name__)

# Seconds between looks at a member's leader while the cluster elects a new one (an
# election takes about one election timeout, 1 s by etcd's default).
_LEADER_POLL_S = 0.05
# Seconds a request waits before trying the members again after every one failed.
_ROUND_PAUSE_S = 0.2


class FailoverClient(etcd.Client):
    """A python-etcd client of every member in ``hosts``, safe for threads to share,
    that fails over to the next member and waits out a new leader's election (see the
    module docs).

    Args:
        hosts: Every member's (host, port).
        read_timeout: Seconds one member may take to answer a request (a watch: its
            own timeout).
        failover_s: Seconds a request goes on trying the members before it fails with
            ``etcd.EtcdConnectionFailed``.

    Raises:
        etcd.EtcdException: no member of ``hosts`` answers.
    """

    def __init__(self, hosts: tuple[tuple[str, int], ...], read_timeout: float,
                 failover_s: float) -> None:
        super().__init__(host=hosts, allow_reconnect=True, read_timeout=read_timeout)
        self._move_lock = threading.Lock()
        self.failover_s = failover_s
        #: the member whose loss the client waits out (None: none): until the member in
        #: use knows another leader, every thread's request waits, not only the one
        #: that found the loss (etcd would drop the others')
        self._lost: str | None = None
        #: every member's client URL, the one in use first, in a fixed order
        self.member_urls = list(dict.fromkeys([self._base_uri,
                                               *sorted(self._machines_cache)]))
        #: the cluster's member id of each client URL, to tell whether a lost member
        #: is still the leader the others know
        self._ids = {url: member_id for member_id, member in self.members.items()
                     for url in member.get("clientURLs", ())}

    # python-etcd's requests all go through these two; its own failover is not used.
    def api_execute(self, path: str, method: str, params: Any = None,
                    timeout: float | None = None) -> Any:
        """Send one request to the member in use, failing over as the class says."""
        return self._failover(path, method, params, timeout, json_body=False)

    def api_execute_json(self, path: str, method: str, params: Any = None,
                         timeout: float | None = None) -> Any:
        """As :meth:`api_execute`, with ``params`` sent as a JSON body."""
        return self._failover(path, method, params, timeout, json_body=True)

    def _failover(self, path: str, method: str, params: Any, timeout: float | None,
                  json_body: bool) -> Any:
        if not path.startswith("/"):
            raise ValueError("Path does not start with /")
        watch = isinstance(params, dict) and params.get("wait") == "true"
        timeout = self.read_timeout if timeout is None else timeout
        deadline = time.monotonic() + self.failover_s
        failed = 0
        while True:
            lost = self._lost
            if lost is not None:
                self._wait_for_leader(lost, deadline)
            member = self._base_uri
            try:
                response = self._send(member + path, method, params, timeout or None,
                                      json_body)
                self._check_cluster_id(response)
                _ = response.data  # read here: an IO error is this member's
            except (HTTPError, HTTPException, OSError) as e:
                if watch and isinstance(e, ReadTimeoutError):
                    raise etcd.EtcdWatchTimedOut(f"Watch timed out: {e!r}", cause=e) from None
                failed += 1
                if time.monotonic() >= deadline:
                    raise etcd.EtcdConnectionFailed(
                        f"no etcd member of {', '.join(self.member_urls)} answered for "
                        f"{self.failover_s:g} s (the last, {member}: {e!r})", cause=e) from None
                logger.debug("etcd member %s did not answer (%r); on to the next", member, e)
                # A read timeout: the member is slow, or the cluster dropped the request
                # (a lost leader); any other error: the member is gone.
                self._move_from(member, lost=not isinstance(e, ReadTimeoutError))
                if failed % len(self.member_urls) == 0:  # every member failed: a pause
                    time.sleep(_ROUND_PAUSE_S)
                continue
            return self._handle_server_response(response)

    def _send(self, url: str, method: str, params: Any, timeout: float | None,
              json_body: bool) -> Any:
        """One try at one member: python-etcd's request, without urllib3's own retries
        of the same member."""
        common = {"timeout": timeout, "redirect": self.allow_redirect, "retries": False,
                  "preload_content": False}
        if json_body:
            return self.http.urlopen(method, url, body=json.dumps(params),
                                     headers={**self._get_headers(),
                                              "Content-Type": "application/json"}, **common)
        if method in (self._MGET, self._MDELETE):
            return self.http.request(method, url, fields=params, headers=self._get_headers(),
                                     **common)
        if method in (self._MPUT, self._MPOST):
            return self.http.request_encode_body(method, url, fields=params,
                                                 encode_multipart=False,
                                                 headers=self._get_headers(), **common)
        raise etcd.EtcdException(f"HTTP method {method} not supported")

    def _move_from(self, member: str, lost: bool) -> None:
        """Use the member after ``member`` (unless another thread has moved on already);
        ``lost``: ``member`` is gone, so requests wait for a leader other than it."""
        with self._move_lock:
            if lost and self._base_uri == member:
                self._lost = member
            if self._base_uri == member:
                at = self.member_urls.index(member) if member in self.member_urls else -1
                self._base_uri = self.member_urls[(at + 1) % len(self.member_urls)]
                logger.info("etcd member %s lost; going on through %s", member,
                            self._base_uri)

    def _wait_for_leader(self, lost: str, deadline: float) -> None:
        """Return once the member in use knows a leader other than ``lost`` (at once when
        ``lost`` was not the leader; the wait then ends for every thread), when it does
        not answer either (the request's failover goes on), or at ``deadline``."""
        lost_id = self._ids.get(lost)
        if lost_id is not None and not self._answers(lost):  # known, and lost indeed
            while time.monotonic() < deadline:
                member = self._base_uri
                if member == lost:
                    return
                try:
                    stats = self.http.request(self._MGET, member + self.version_prefix +
                                              "/stats/self", timeout=self.read_timeout,
                                              retries=False)
                    leader = json.loads(stats.data.decode())["leaderInfo"]["leader"]
                except (HTTPError, HTTPException, OSError, ValueError, KeyError, TypeError):
                    return
                if leader.strip("0") and leader != lost_id:
                    break
                time.sleep(_LEADER_POLL_S)
            else:
                return
        with self._move_lock:
            if self._lost == lost:
                self._lost = None

    def _answers(self, member: str) -> bool:
        """Whether ``member`` answers now (a short look: a lost one refuses at once)."""
        try:
            self.http.request(self._MGET, member + "/version",
                              timeout=min(self.read_timeout, 1.0), retries=False)
        except (HTTPError, HTTPException, OSError):
            return False
        return True

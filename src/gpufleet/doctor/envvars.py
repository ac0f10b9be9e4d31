"""The environment variables NCCL, Gloo and PyTorch's distributed stack read, and a check.

NCCL, Gloo and PyTorch read their settings from the environment and ignore every name
they do not know, silently. ``NCCL_IB_DISABLED=1`` (the real name is ``NCCL_IB_DISABLE``)
leaves InfiniBand on, and nothing says so. :func:`check_environment` compares every
variable under one of :data:`PREFIXES` against the tables below and words a finding for
each name that is misspelled, renamed, removed or unknown, and for values that cannot
work.

Where the names come from:

* ``NCCL_DOCUMENTED``: the "Environment Variables" page of the NCCL user guide (NCCL 2.30),
  both its "System configuration" and "Debugging" sections.
* ``NCCL_SOURCE_ONLY``: read by NCCL (``NCCL_PARAM``/``ncclGetEnv`` in its sources) but not
  on that page.
* ``TORCH_NAMES``: PyTorch's ProcessGroupNCCL environment-variable page and the names in
  ``ProcessGroupNCCL.hpp`` / ``FlightRecorder.hpp``; ``GLOO_NAMES``: the names libtorch's
  Gloo backend reads; ``TORCHELASTIC_NAMES``: what torch.distributed.elastic sets and reads.

Example:
    >>> [f.name for f in check_environment({"NCCL_IB_DISABLED": "1"})]
    ['NCCL_IB_DISABLED']
    >>> check_environment({"NCCL_IB_DISABLED": "1"})[0].suggestion
    'NCCL_IB_DISABLE'
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

# Variables under these prefixes are checked; anything else is left alone.
PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "TORCH_GLOO_", "GLOO_",
            "TORCH_DISTRIBUTED_", "TORCHELASTIC_")

# Network plugins and tools that read their own NCCL_-prefixed names; not checked.
PLUGIN_PREFIXES = ("NCCL_GPUDIRECTTCPX_", "NCCL_FASTRAK_", "NCCL_TESTS_")

NCCL_DOCUMENTED = frozenset("NCCL_" + s for s in """
    SOCKET_IFNAME SOCKET_FAMILY SOCKET_MAGIC SOCKET_RETRY_CNT SOCKET_RETRY_SLEEP_MSEC
    SOCKET_POLL_TIMEOUT_MSEC SOCKET_NTHREADS NSOCKS_PERTHREAD CROSS_NIC
    IB_HCA IB_TIMEOUT IB_RETRY_CNT IB_GID_INDEX IB_ADDR_FAMILY IB_ADDR_RANGE
    IB_ROCE_VERSION_NUM IB_SL IB_TC IB_FIFO_TC IB_RETURN_ASYNC_EVENTS
    OOB_NET_ENABLE OOB_NET_IFNAME UID_STAGGER_THRESHOLD UID_STAGGER_RATE
    NET NET_PLUGIN TUNER_PLUGIN PROFILER_PLUGIN ENV_PLUGIN IGNORE_CPU_AFFINITY CONF_FILE
    DEBUG DEBUG_FILE DEBUG_SUBSYS DEBUG_TIMESTAMP_FORMAT DEBUG_TIMESTAMP_LEVELS
    COLLNET_ENABLE COLLNET_NODE_THRESHOLD CTA_POLICY NETDEVS_POLICY MULTI_RANK_GPU_ENABLE
    TOPO_FILE TOPO_DUMP_FILE SET_THREAD_NAME
    P2P_DISABLE P2P_LEVEL P2P_DIRECT_DISABLE SHM_DISABLE BUFFSIZE NTHREADS
    MAX_NCHANNELS MIN_NCHANNELS CHECKS_DISABLE CHECK_POINTERS CHECK_MODE LAUNCH_MODE
    IB_DISABLE IB_AR_THRESHOLD IB_OOO_RQ IB_QPS_PER_CONNECTION IB_SPLIT_DATA_ON_QPS
    IB_PCI_RELAXED_ORDERING IB_ADAPTIVE_ROUTING IB_ECE_ENABLE MEM_SYNC_DOMAIN
    CUMEM_ENABLE CUMEM_HOST_ENABLE NET_GDR_LEVEL NET_GDR_C2C NET_GDR_READ
    GDRCOPY_ENABLE GDRCOPY_FIFO_ENABLE GDRCOPY_SYNC_ENABLE GDRCOPY_FLUSH_ENABLE
    NET_SHARED_BUFFERS NET_SHARED_COMMS IGNORE_NET_MISMATCH IGNORE_COLLNET_MISMATCH
    ALGO PROTO NVB_DISABLE PXN_DISABLE P2P_PXN_LEVEL PXN_C2C RUNTIME_CONNECT
    GRAPH_REGISTER LOCAL_REGISTER LEGACY_CUDA_REGISTER WIN_ENABLE SET_STACK_SIZE
    GRAPH_MIXING_SUPPORT GRAPH_STREAM_ORDERING DMABUF_ENABLE P2P_NET_CHUNKSIZE
    P2P_LL_THRESHOLD ALLOC_P2P_NET_LL_BUFFERS COMM_BLOCKING CGA_CLUSTER_SIZE
    MAX_CTAS MIN_CTAS NVLS_ENABLE IB_MERGE_NICS NET_MERGE_POLICY MNNVL_ENABLE MNNVL_UUID
    MNNVL_CLIQUE_ID RAS_ENABLE RAS_ADDR RAS_TIMEOUT_FACTOR LAUNCH_ORDER_IMPLICIT
    LAUNCH_RACE_FATAL IPC_USE_ABSTRACT_SOCKET SYM_GIN_KERNELS_ENABLE
""".split())

NCCL_SOURCE_ONLY = frozenset("NCCL_" + s for s in """
    COMM_ID HOSTID NCHANNELS_PER_NET_PEER NVLS_NCHANNELS NVLS_CHUNKSIZE
    NVLSTREE_MAX_CHUNKSIZE WORK_FIFO_BYTES P2P_NVL_CHUNKSIZE P2P_PCI_CHUNKSIZE
    IB_MERGE_VFS IB_DEVICE_PCI_ORDER NET_MERGE_LEVEL GRAPH_DUMP_FILE_RANK
""".split())

TORCH_NAMES = frozenset("""
    TORCH_NCCL_ASYNC_ERROR_HANDLING TORCH_NCCL_HIGH_PRIORITY TORCH_NCCL_BLOCKING_WAIT
    TORCH_NCCL_DUMP_ON_TIMEOUT TORCH_NCCL_PROPAGATE_ERROR TORCH_NCCL_DESYNC_DEBUG
    TORCH_NCCL_ENABLE_TIMING TORCH_NCCL_ENABLE_MONITORING TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC
    TORCH_NCCL_RETHROW_CUDA_ERRORS TORCH_NCCL_TRACE_BUFFER_SIZE TORCH_NCCL_TRACE_CPP_STACK
    TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC TORCH_NCCL_COORD_CHECK_MILSEC
    TORCH_NCCL_LOG_CPP_STACK_ON_UNCLEAN_SHUTDOWN TORCH_NCCL_EXTRA_DUMP_ON_EXEC
    TORCH_NCCL_CUDA_EVENT_CACHE TORCH_NCCL_RANKS_PER_ROOT TORCH_NCCL_NAN_CHECK
    TORCH_NCCL_AVOID_RECORD_STREAMS TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK
    TORCH_NCCL_BCAST_UNIQUEID TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE TORCH_NCCL_DEBUG_INFO_PIPE_FILE
    TORCH_NCCL_ABORT_IN_DESTROY_PG
    TORCH_FR_BUFFER_SIZE TORCH_FR_CPP_STACK TORCH_FR_DUMP_TEMP_FILE
    TORCH_FR_DUMP_DYNAMIC_FILE_NAME
    TORCH_GLOO_LAZY_INIT TORCH_DISTRIBUTED_DEBUG TORCH_DISTRIBUTED_USE_TORCHCOMMS
    TORCH_DISTRIBUTED_COMPILE_ON_ONE_RANK
""".split())

GLOO_NAMES = frozenset("""
    GLOO_SOCKET_IFNAME GLOO_DEVICE_TRANSPORT GLOO_DISABLE_CONNECTION_RETRIES
    GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER GLOO_ENABLE_STORE_V2_API GLOO_LOG_LEVEL
""".split())

TORCHELASTIC_NAMES = frozenset("TORCHELASTIC_" + s for s in """
    RESTART_COUNT MAX_RESTARTS RUN_ID USE_AGENT_STORE ERROR_FILE ENABLE_FILE_TIMER
    TIMER_FILE HEALTH_CHECK_PORT UNINTERRUPTIBLE_STATE_TIMEOUT SIGNALS_TO_HANDLE
    LOG_LINE_PREFIX_TEMPLATE ETCD_BINARY_PATH
""".split())

# Old names that are still read, with the name to use now.
RENAMED: dict[str, str] = {
    # PyTorch reads these with a deprecation warning (ProcessGroupNCCL.hpp).
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_ENABLE_TIMING": "TORCH_NCCL_ENABLE_TIMING",
    "NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",
    # NCCL aliases (NCCL docs): renamed in 2.4 and 2.5, replaced by the CTA limits in 2.17.
    "NCCL_IB_GDR_LEVEL": "NCCL_NET_GDR_LEVEL",
    "NCCL_MAX_NRINGS": "NCCL_MAX_CTAS",
    "NCCL_MIN_NRINGS": "NCCL_MIN_CTAS",
    "NCCL_MAX_NCHANNELS": "NCCL_MAX_CTAS",
    "NCCL_MIN_NCHANNELS": "NCCL_MIN_CTAS",
}

# Names current NCCL no longer reads at all, with what to do instead.
REMOVED: dict[str, str] = {
    "NCCL_IB_CUDA_SUPPORT": "removed in NCCL 2.4; use NCCL_NET_GDR_LEVEL",
    "NCCL_SINGLE_RING_THRESHOLD": "removed in NCCL 2.3; NCCL picks the channels itself",
    "NCCL_LL_THRESHOLD": "removed in NCCL 2.5; use NCCL_PROTO if you must force a protocol",
    "NCCL_TREE_THRESHOLD": "removed in NCCL 2.5; use NCCL_ALGO if you must force an algorithm",
    "NCCL_RINGS": "removed in NCCL 2.5; NCCL builds its rings from the topology "
                  "(NCCL_TOPO_FILE to describe it)",
    "NCCL_CHECKS_DISABLE": "deprecated since NCCL 2.2.12, where argument checks became cheap",
}

# Names found in scripts and posts that NCCL never read, and the name that was meant.
MISTAKES: dict[str, str] = {
    "NCCL_IB_DISABLED": "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLED": "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLED": "NCCL_SHM_DISABLE",
    "NCCL_SOCKET_IFNAMES": "NCCL_SOCKET_IFNAME",
    "NCCL_SOCKET_INTERFACE": "NCCL_SOCKET_IFNAME",
    "NCCL_IFNAME": "NCCL_SOCKET_IFNAME",
    "NCCL_DEBUG_LEVEL": "NCCL_DEBUG",
    "NCCL_LOG_LEVEL": "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYSTEM": "NCCL_DEBUG_SUBSYS",
    "NCCL_IB_ENABLE": "NCCL_IB_DISABLE",
    "NCCL_NET_GDR_DISABLE": "NCCL_NET_GDR_LEVEL",
    "NCCL_TIMEOUT": "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "GLOO_IFNAME": "GLOO_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAMES": "GLOO_SOCKET_IFNAME",
    "TORCH_NCCL_TRACE_BUFFER": "TORCH_NCCL_TRACE_BUFFER_SIZE",
}

KNOWN = (NCCL_DOCUMENTED | NCCL_SOURCE_ONLY | TORCH_NAMES | GLOO_NAMES | TORCHELASTIC_NAMES
         | frozenset(REMOVED) | frozenset(RENAMED))

# An unknown name this similar (difflib ratio) to a known one is taken for a typo of it.
TYPO_RATIO = 0.9


@dataclass(frozen=True)
class Finding:
    """One problem with one environment variable.

    Attributes:
        name: the variable as set.
        value: its value.
        severity: ``"fail"`` (what the user asked for is not in effect, or init will
            fail) or ``"warn"`` (works, but not as written or not as documented).
        message: what is wrong, in a sentence.
        fix: what to do.
        suggestion: the real name that was probably meant, if any.
    """

    name: str
    value: str
    severity: str
    message: str
    fix: str
    suggestion: str | None = None


def watched(name: str) -> bool:
    """True for a name under one of :data:`PREFIXES` (and not a plugin's own)."""
    return name.startswith(PREFIXES) and not name.startswith(PLUGIN_PREFIXES)


def check_environment(environ: Mapping[str, str],
                      interfaces: Iterable[str] | None = None) -> list[Finding]:
    """Check every watched variable of ``environ``; returns one finding per problem.

    Args:
        environ: usually ``os.environ``.
        interfaces: network interface names on this host, to check ``NCCL_SOCKET_IFNAME``
            and ``GLOO_SOCKET_IFNAME`` against; ``None`` skips that check.

    Example:
        >>> check_environment({"NCCL_DEBUG": "INFO", "PATH": "/bin"})
        []
    """
    findings = []
    for name in sorted(n for n in environ if watched(n)):
        value = environ[name]
        finding = _check_name(name, value)
        if finding is None:
            finding = _check_value(name, value, None if interfaces is None else
                                   list(interfaces))
        if finding is not None:
            findings.append(finding)
    return findings


def _check_name(name: str, value: str) -> Finding | None:
    if name in MISTAKES:
        right = MISTAKES[name]
        return Finding(name, value, "fail", f"{name} is not read by NCCL or PyTorch, so this "
                       f"setting has no effect. Did you mean {right}?",
                       f"rename it: export {right}={value} (and unset {name})", right)
    if name in RENAMED:
        new = RENAMED[name]
        return Finding(name, value, "warn", f"{name} is an old name; it still works but "
                       f"{new} is the current one", f"rename it: export {new}={value}", new)
    if name in REMOVED:
        return Finding(name, value, "warn", f"{name} is no longer read: {REMOVED[name]}",
                       f"unset {name}")
    if name in KNOWN:
        return None
    close = difflib.get_close_matches(name, sorted(KNOWN), n=1, cutoff=0.6)
    guess = close[0] if close else None
    if guess and difflib.SequenceMatcher(None, name, guess).ratio() >= TYPO_RATIO:
        return Finding(name, value, "fail", f"{name} is not a variable NCCL or PyTorch "
                       f"reads, so this setting has no effect. Did you mean {guess}?",
                       f"rename it: export {guess}={value} (and unset {name})", guess)
    hint = f" The closest known name is {guess}." if guess else ""
    return Finding(name, value, "warn", f"{name} is not in the documented NCCL/PyTorch "
                   f"variables; unless a plugin or a newer version reads it, it does "
                   f"nothing.{hint}", f"check the spelling, or unset {name}", guess)


def _one_of(*choices: str) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        if value.upper() in choices:
            return None
        return f"must be one of {', '.join(choices)}"
    return check


def _int_range(lo: int, hi: int) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        try:
            number = int(value, 0)
        except ValueError:
            return f"must be an integer from {lo} to {hi}"
        return None if lo <= number <= hi else f"must be from {lo} to {hi}"
    return check


def _token_list(*tokens: str) -> Callable[[str], str | None]:
    """A comma list of ``tokens``, each may carry ``^`` (exclude); per-function lists
    (``allreduce:tree;...``, NCCL >= 2.24) are not checked."""
    def check(value: str) -> str | None:
        if ":" in value or ";" in value:
            return None
        bad = [t for t in value.split(",") if t.strip().lstrip("^").upper() not in tokens]
        return f"unknown {', '.join(bad)}; valid: {', '.join(tokens)}" if bad else None
    return check


_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")
_SUBSYS = ("INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC",
           "ALLOC_HOST", "CALL", "PROXY", "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS",
           "DESTROY", "ALL")


def _level(value: str) -> str | None:
    if value.upper() in _LEVELS or value.isdigit():
        return None
    return f"must be one of {', '.join(_LEVELS)} (or a legacy integer)"


VALUE_RULES: dict[str, Callable[[str], str | None]] = {
    "NCCL_DEBUG": _one_of("VERSION", "WARN", "INFO", "TRACE", "ABORT"),
    "NCCL_DEBUG_SUBSYS": _token_list(*_SUBSYS),
    "NCCL_SOCKET_FAMILY": _one_of("AF_INET", "AF_INET6"),
    "NCCL_IB_ADDR_FAMILY": _one_of("AF_INET", "AF_INET6"),
    "NCCL_P2P_LEVEL": _level,
    "NCCL_NET_GDR_LEVEL": _level,
    "NCCL_PROTO": _token_list("LL", "LL128", "SIMPLE"),
    "NCCL_ALGO": _token_list("RING", "TREE", "COLLNET", "COLLNETCHAIN", "COLLNETDIRECT",
                             "NVLS", "NVLSTREE", "PAT"),
    "NCCL_NTHREADS": _one_of("64", "128", "256", "512"),
    "NCCL_IB_TIMEOUT": _int_range(1, 31),
    "NCCL_IB_RETRY_CNT": _int_range(0, 7),
    "NCCL_SOCKET_NTHREADS": _int_range(1, 16),
    "NCCL_CROSS_NIC": _int_range(0, 2),
    "NCCL_NVLS_ENABLE": _int_range(0, 2),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": _int_range(0, 3),
    "TORCH_DISTRIBUTED_DEBUG": _one_of("OFF", "INFO", "DETAIL"),
}
_BOOLEAN = re.compile(r"_(DISABLE|ENABLE)$")


def _check_value(name: str, value: str, interfaces: list[str] | None) -> Finding | None:
    rule = VALUE_RULES.get(name)
    if rule is None and _BOOLEAN.search(name):
        rule = _int_range(0, 2) if name.endswith("_ENABLE") else _int_range(0, 1)
    problem = rule(value.strip()) if rule else None
    if problem:
        return Finding(name, value, "warn", f"{name}={value!r}: {problem}",
                       f"set a valid value or unset {name}")
    if interfaces is not None and name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        match = nccl_ifname_match if name.startswith("NCCL") else gloo_ifname_match
        if not any(match(value, i) for i in interfaces):
            return Finding(name, value, "fail", f"{name}={value!r} matches no network "
                           f"interface on this host ({', '.join(sorted(interfaces))}); "
                           "process group init will fail", f"set {name} to one of the "
                           "interfaces above, or unset it to let the library choose")
    return None


def nccl_ifname_match(spec: str, interface: str) -> bool:
    """Does ``interface`` pass NCCL's ``NCCL_SOCKET_IFNAME`` filter ``spec``?

    A comma list of prefixes; ``^`` first excludes them, ``=`` (after any ``^``) makes
    them exact names.

    Example:
        >>> nccl_ifname_match("eth", "eth0"), nccl_ifname_match("^docker", "docker0")
        (True, False)
    """
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    hit = any(interface == t if exact else interface.startswith(t) for t in tokens)
    return hit != exclude


def gloo_ifname_match(spec: str, interface: str) -> bool:
    """Does ``interface`` appear in Gloo's ``GLOO_SOCKET_IFNAME`` (exact names, commas)?"""
    return interface in [t.strip() for t in spec.split(",")]

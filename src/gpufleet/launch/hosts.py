"""The hosts of a one-shell multi-node job: ``--hosts h1,h2`` or a DeepSpeed-style
hostfile, and the environment that goes to them.

A hostfile has one host a line, optionally with its ranks (``slots``); ``#`` starts a
comment::

    # name-or-address  [slots=N]
    node1 slots=8
    node2 slots=8

Example:
    >>> [(h.name, h.slots) for h in parse_hosts("n1,alice@n2")]
    [('n1', None), ('alice@n2', None)]
    >>> parse_hostfile_text("n1 slots=2\\n# spare\\nn2 slots=2\\n")[1].slots
    2
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpufleet.errors import ConfigError

# A host as ssh takes it: [user@]name, an address, or an ssh_config alias.
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.%:@\[\]-]*")

# What every node gets from the launcher's environment when it is set (besides
# ``--env NAME``): Python's path and hashing, thread counts, the collectives' settings, and
# the caches and credentials of the Hugging Face hub and the metric services.
FORWARD_NAMES = frozenset({
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONWARNINGS",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM",
    "TORCH_HOME", "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL",
    "TORCH_SHOW_CPP_STACKTRACES", "GPUFLEET_CACHE", "GPUFLEET_PEAK_FLOPS",
})
FORWARD_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "HF_", "WANDB_", "MLFLOW_")


@dataclass(frozen=True)
class Host:
    """One node of the job.

    Attributes:
        name: What ``ssh`` is given: ``[user@]host``, an address or an ssh_config alias.
        slots: Ranks on this node (the hostfile's ``slots=N``); None: ``--nproc`` or the
            node's default (one per visible GPU, 1 on CPU).
    """

    name: str
    slots: int | None = None

    @property
    def label(self) -> str:
        """The host without its user: the prefix of the node's output lines."""
        return self.name.rsplit("@", 1)[-1]


def parse_hosts(text: str) -> list[Host]:
    """Read ``--hosts h1,h2,...``."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ConfigError(f"--hosts {text!r} names no host. Give them comma-separated, "
                          "e.g. --hosts node1,node2.")
    return _checked([Host(_host(name, f"--hosts {text!r}")) for name in names])


def read_hostfile(path: str | Path) -> list[Host]:
    """Read a hostfile (see the module's docstring)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"--hostfile {path}: cannot read it ({err.strerror}). Give a "
                          "file with one `HOST slots=N` a line.") from err
    return parse_hostfile_text(text, str(path))


def parse_hostfile_text(text: str, where: str = "hostfile") -> list[Host]:
    """Read the lines of a hostfile; ``where`` names it in errors."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *fields = line.split()
        slots = None
        for item in fields:
            key, _, value = item.partition("=")
            if key != "slots" or not value.isdigit() or int(value) < 1:
                raise ConfigError(
                    f"{where}, line {number}: {raw.strip()!r}: {item!r} is not understood. "
                    "Write `HOST` or `HOST slots=N` (N ranks on that host, at least 1).")
            slots = int(value)
        hosts.append(Host(_host(name, f"{where}, line {number}"), slots))
    if not hosts:
        raise ConfigError(f"{where} names no host. Write one `HOST slots=N` a line.")
    return _checked(hosts)


def _host(name: str, where: str) -> str:
    if not _HOST.fullmatch(name):
        raise ConfigError(f"{where}: {name!r} is not a host name. Give [user@]host, an "
                          "address or an ssh_config alias (letters, digits, . _ - : @).")
    return name


def _checked(hosts: list[Host]) -> list[Host]:
    labels = [h.label for h in hosts]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ConfigError(f"{', '.join(twice)} appear(s) twice among the hosts. Name each "
                          "node once; give a node more ranks with `slots=N` in a hostfile "
                          "(or --nproc N).")
    return hosts


def forwarded_env(environ: Mapping[str, str], extra: Iterable[str] = ()) -> dict[str, str]:
    """The variables every node gets: the allow-list's that are set in ``environ``, plus
    each ``NAME`` (its value here) or ``NAME=VALUE`` of ``extra`` (``--env``).

    Example:
        >>> forwarded_env({"NCCL_DEBUG": "INFO", "RANK": "3", "A": "1"}, ["A", "B=2"])
        {'NCCL_DEBUG': 'INFO', 'A': '1', 'B': '2'}
    """
    env = {name: value for name, value in environ.items()
           if name in FORWARD_NAMES or name.startswith(FORWARD_PREFIXES)}
    for item in extra:
        name, sep, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"--env {item!r}: {name!r} is not a variable name. Give "
                              "--env NAME (its value here) or --env NAME=VALUE.")
        if not sep:
            if name not in environ:
                raise ConfigError(f"--env {name}: {name} is not set here, so there is no "
                                  f"value to send. Set it, or give --env {name}=VALUE.")
            value = environ[name]
        env[name] = value
    return env

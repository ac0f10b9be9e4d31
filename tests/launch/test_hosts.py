"""Hosts and hostfiles of a one-shell multi-node job, and the environment sent to them."""

from __future__ import annotations

import pytest

from gpufleet.errors import ConfigError
from gpufleet.launch.hosts import (
    Host,
    forwarded_env,
    parse_hostfile_text,
    parse_hosts,
    read_hostfile,
)


def test_hosts_list_keeps_order_and_users():
    hosts = parse_hosts("n1, alice@n2 ,10.0.0.3,")
    assert hosts == [Host("n1"), Host("alice@n2"), Host("10.0.0.3")]
    assert [h.label for h in hosts] == ["n1", "n2", "10.0.0.3"]


def test_hostfile_reads_slots_comments_and_blank_lines(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# the cluster\nn1 slots=2\n\n  n2   slots=1  # small one\nn3\n")
    assert read_hostfile(path) == [Host("n1", 2), Host("n2", 1), Host("n3", None)]


@pytest.mark.parametrize(("text", "words"), [
    ("n1 slots=0\n", ["line 1", "'slots=0'", "HOST slots=N"]),
    ("n1\nn2 gpus=2\n", ["line 2", "'gpus=2'"]),
    ("n1 slots=two\n", ["'slots=two'"]),
    ("# nothing\n\n", ["names no host"]),
    ("-oProxyCommand=x slots=1\n", ["not a host name"]),
    ("n1\nn1 slots=2\n", ["n1 appear(s) twice"]),
])
def test_bad_hostfile_lines_are_named(text, words):
    with pytest.raises(ConfigError) as info:
        parse_hostfile_text(text, "hosts.txt")
    for word in words:
        assert word in str(info.value)


def test_missing_hostfile_says_so(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        read_hostfile(tmp_path / "nope")


def test_a_host_like_an_ssh_option_is_refused():
    with pytest.raises(ConfigError, match="not a host name"):
        parse_hosts("n1,-oProxyCommand=touch_x")
    with pytest.raises(ConfigError, match="twice"):
        parse_hosts("root@n1,n1")


def test_environment_forwarded_by_name_only():
    environ = {"PYTHONPATH": "/src", "NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "eth1",
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "4", "SECRET": "s", "PATH": "/bin",
               "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "SLURM_PROCID": "0",
               "CUDA_VISIBLE_DEVICES": "0", "MY_FLAG": "on"}
    env = forwarded_env(environ, ["MY_FLAG", "MODE=fast", "EMPTY="])
    assert env == {"PYTHONPATH": "/src", "NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "eth1",
                   "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "4", "MY_FLAG": "on",
                   "MODE": "fast", "EMPTY": ""}


def test_env_flag_errors_name_the_variable():
    with pytest.raises(ConfigError, match="--env NOT_SET=VALUE"):
        forwarded_env({}, ["NOT_SET"])
    with pytest.raises(ConfigError, match="'1BAD' is not a variable name"):
        forwarded_env({}, ["1BAD=2"])

"""`gpufleet doctor`: machine checks and the NCCL/Gloo/PyTorch environment variables."""

import json
import os
import socket

import pytest

from gpufleet.doctor import envvars
from gpufleet.doctor.checks import (
    check_env,
    check_master_addr,
    check_ports,
    check_shm,
    shm_result,
)
from gpufleet.doctor.cli import _print_table
from gpufleet.doctor.gpus import check_gpus
from gpufleet.doctor.result import CheckResult


def _nvml_works() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.fixture
def clean_env(monkeypatch):
    """os.environ without any variable doctor checks (run_cli copies os.environ)."""
    for name in list(os.environ):
        if envvars.watched(name) or name in ("MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(name)


def test_misspelled_nccl_variable_is_a_problem_with_the_real_name(run_cli, clean_env):
    proc = run_cli("doctor", env={"NCCL_IB_DISABLED": "1"}, expect=1)
    line = next(x for x in proc.stdout.splitlines() if "env NCCL_IB_DISABLED" in x)
    assert line.split()[0] == "FAIL"
    assert "Did you mean NCCL_IB_DISABLE?" in line
    assert "fix: rename it: export NCCL_IB_DISABLE=1" in proc.stdout
    assert "something blocks training (exit 1)" in proc.stdout


def test_deprecated_name_gets_its_replacement_and_does_not_block(run_cli, clean_env):
    proc = run_cli("doctor", "--json", env={"NCCL_ASYNC_ERROR_HANDLING": "3"}, expect=0)
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    found = checks["env NCCL_ASYNC_ERROR_HANDLING"]
    assert found["status"] == "warn"
    assert found["details"]["suggestion"] == "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in found["fix"]


def test_clean_environment_json_lists_every_check(run_cli, clean_env):
    report = json.loads(run_cli("doctor", "--json").stdout)
    assert report["exit_code"] == 0 and report["blocked"] is False
    checks = {c["name"]: c for c in report["checks"]}
    assert {"versions", "gpus", "cpus", "memory", "shared memory", "free port",
            "environment"} <= set(checks)
    assert not [n for n in checks if n.startswith("env ")]
    assert checks["environment"]["status"] == "ok"
    assert "no NCCL_*" in checks["environment"]["message"]
    assert checks["versions"]["details"]["torch"]
    assert checks["cpus"]["details"]["usable"] >= 1
    assert all(c["status"] in ("ok", "warn") for c in report["checks"])


@pytest.mark.skipif(_nvml_works(), reason="this machine has an NVIDIA driver")
def test_no_gpu_is_a_plain_warning():
    (result,) = check_gpus(torch_cuda_count=0)
    assert result.status == "warn"
    assert result.message.startswith("no NVIDIA GPU found")
    assert "Training will run on the CPU" in result.message
    assert result.details["count"] == 0


@pytest.mark.parametrize(("name", "value", "severity", "suggestion"), [
    ("NCCL_IB_DISABLED", "1", "fail", "NCCL_IB_DISABLE"),
    ("NCCL_SOCKET_IFNAMES", "lo", "fail", "NCCL_SOCKET_IFNAME"),
    ("NCCL_DEBUG_LEVEL", "INFO", "fail", "NCCL_DEBUG"),
    ("NCCL_P2P_DISABLED", "1", "fail", "NCCL_P2P_DISABLE"),
    ("NCCL_NET_GDR_LEVLE", "PHB", "fail", "NCCL_NET_GDR_LEVEL"),  # a plain typo
    ("NCCL_BLOCKING_WAIT", "1", "warn", "TORCH_NCCL_BLOCKING_WAIT"),
    ("NCCL_IB_GDR_LEVEL", "PHB", "warn", "NCCL_NET_GDR_LEVEL"),
    ("NCCL_LL_THRESHOLD", "0", "warn", None),
    ("NCCL_SOMETHING_NEW", "1", "warn", None),
])
def test_names(name, value, severity, suggestion):
    (finding,) = envvars.check_environment({name: value})
    assert finding.severity == severity
    if suggestion:
        assert finding.suggestion == suggestion
        assert suggestion in finding.message + finding.fix


@pytest.mark.parametrize(("env", "problem"), [
    ({"NCCL_DEBUG": "VERBOSE"}, "must be one of VERSION, WARN, INFO, TRACE"),
    ({"NCCL_P2P_LEVEL": "NVLINK"}, "must be one of LOC, NVL, PIX"),
    ({"NCCL_PROTO": "LL,LL256"}, "unknown LL256"),
    ({"NCCL_IB_DISABLE": "yes"}, "must be an integer"),
    ({"TORCH_DISTRIBUTED_DEBUG": "ALL"}, "OFF, INFO, DETAIL"),
])
def test_values(env, problem):
    (finding,) = envvars.check_environment(env)
    assert finding.severity == "warn" and problem in finding.message


def test_known_names_and_values_pass():
    env = {"NCCL_DEBUG": "info", "NCCL_DEBUG_SUBSYS": "INIT,^COLL", "NCCL_P2P_LEVEL": "NVL",
           "NCCL_ALGO": "allreduce:tree;ring", "NCCL_IB_DISABLE": "1",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "GLOO_SOCKET_IFNAME": "lo",
           "NCCL_SOCKET_IFNAME": "^docker,lo", "TORCHELASTIC_RESTART_COUNT": "0",
           "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": "eth1", "HOME": "/root"}
    assert envvars.check_environment(env, interfaces=["lo", "eth0"]) == []


def test_socket_ifname_matching_no_interface_fails():
    found = envvars.check_environment({"NCCL_SOCKET_IFNAME": "=eth7",
                                       "GLOO_SOCKET_IFNAME": "eth"}, interfaces=["eth0", "lo"])
    assert [(f.name, f.severity) for f in found] == [("GLOO_SOCKET_IFNAME", "fail"),
                                                     ("NCCL_SOCKET_IFNAME", "fail")]
    assert "eth0, lo" in found[1].message
    assert envvars.nccl_ifname_match("eth", "eth0")
    assert not envvars.nccl_ifname_match("=eth", "eth0")
    assert not envvars.nccl_ifname_match("^lo,docker", "docker0")
    assert envvars.nccl_ifname_match("^=docker", "docker0")


def test_nccl_conf_file_is_checked_too(tmp_path):
    conf = tmp_path / "nccl.conf"
    conf.write_text("# site settings\nNCCL_SOCKET_IFNAMES=lo\nNCCL_DEBUG=WARN\n")
    results = check_env({"NCCL_CONF_FILE": str(conf)})
    bad = [r for r in results if r.status == "fail"]
    assert [r.name for r in bad] == [f"env NCCL_SOCKET_IFNAMES (in {conf})"]


def test_master_port_taken_here_blocks(clean_env):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        results = check_ports({"MASTER_PORT": str(port)})
        taken = check_ports({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert [r.status for r in results] == ["ok", "fail"]
    assert f"MASTER_PORT={port} is taken" in results[1].message
    assert taken[1].status == "fail"
    elsewhere = check_ports({"MASTER_ADDR": "192.0.2.1", "MASTER_PORT": str(port)})
    assert elsewhere[1].status == "ok" and "not this host" in elsewhere[1].message
    assert check_ports({"MASTER_PORT": "http"})[1].status == "fail"


def test_master_addr_must_resolve():
    (bad,) = check_master_addr({"MASTER_ADDR": "no-such-host.invalid"})
    assert bad.status == "fail" and "does not resolve" in bad.message
    (good,) = check_master_addr({"MASTER_ADDR": "localhost"})
    assert good.status == "ok"
    assert check_master_addr({}) == []


def test_small_or_missing_shared_memory_warns_with_the_docker_fix(tmp_path):
    small = shm_result("/dev/shm", 64 << 20, 60 << 20)
    assert small.status == "warn" and "--shm-size" in small.fix
    assert shm_result("/dev/shm", 8 << 30, 8 << 30).status == "ok"
    assert check_shm(str(tmp_path / "no-shm")).status == "warn"


def test_terminal_table_shows_text_verbatim(capsys):
    _print_table([CheckResult("env NCCL_X", "fail", "value '[bold]x[/]'", "unset it")], 1)
    out = capsys.readouterr().out
    assert "[bold]x[/]" in out and "FAIL" in out and "something blocks training" in out


class _FakeNvml:
    """Two GPUs joined by NVLink, as NVML's Python binding reports them; this machine has
    no NVIDIA driver, so the real library cannot run here."""

    NVML_NVLINK_MAX_LINKS, NVML_FEATURE_ENABLED = 18, 1
    NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK = 2, 0

    class NVMLError(Exception):
        pass

    def __init__(self, nvlink: bool):
        self.nvlink = nvlink
        self.bus = ["00000000:07:00.0", "00000000:0F:00.0"]

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return 2
    def nvmlSystemGetDriverVersion(self): return "560.35.03"
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetName(self, h): return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Mem", (), {"total": 80 << 30, "used": 1 << 30})()

    def nvmlDeviceGetPciInfo(self, h):
        return type("Pci", (), {"busId": self.bus[h].encode()})()

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [type("P", (), {"pid": 4242})()] if h == 1 else []

    def nvmlDeviceGetNvLinkState(self, h, link):
        if not self.nvlink or link >= 4:
            raise self.NVMLError("no such link")
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return self.nvmlDeviceGetPciInfo(1 - h)

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        return self.NVML_P2P_STATUS_OK if self.nvlink else 5

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 50  # SYS: across CPU sockets


@pytest.mark.parametrize("nvlink", [True, False])
def test_gpu_report_from_nvml(monkeypatch, nvlink):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", _FakeNvml(nvlink))
    results = {r.name: r for r in check_gpus(torch_cuda_count=0)}
    gpus = results["gpus"]
    assert gpus.status == "ok" and gpus.message.startswith("2 x NVIDIA H100 80GB HBM3")
    assert "driver 560.35.03" in gpus.message
    assert results["gpu processes"].status == "warn" and "4242" in results["gpu processes"].message
    topo = results["gpu topology"]
    assert topo.details["pairs"] == ({"0-1": "NV4"} if nvlink else {"0-1": "SYS"})
    assert topo.status == ("ok" if nvlink else "warn")
    seen = results["torch sees gpus"]
    assert seen.status == "warn" and "torch sees none" in seen.message

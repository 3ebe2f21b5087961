"""What each rank's communication libraries are told (dpnb.engine.setup.backend_env).

No GPU here: these are the settings the NCCL path gets, checked as a plan.
"""

from dpnb.engine.group.netplan import backend_env


def test_local_gloo_stays_on_loopback():
    assert backend_env({"backend": "gloo", "local_cluster": True}) == {"GLOO_SOCKET_IFNAME": "lo"}


def test_nccl_across_hosts_pins_both_interfaces_and_survives_a_slow_op():
    env = backend_env({"backend": "nccl", "local_cluster": False, "ifname": "ib0",
                       "data_ifname": "ib0"})
    assert env == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0",
                   "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}


def test_nccl_takes_the_route_to_the_group_not_the_controllers_vpn():
    """The controller is reached over a VPN (tun0), rank 0 over the data
    network (ib0): NCCL's traffic must not be forced onto the VPN."""
    env = backend_env({"backend": "nccl", "local_cluster": False, "ifname": "tun0",
                       "data_ifname": "ib0"})
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and env["GLOO_SOCKET_IFNAME"] == "tun0"
    # no route to the group's address: NCCL picks its own, as under torchrun
    env = backend_env({"backend": "nccl", "local_cluster": False, "ifname": "tun0",
                       "data_ifname": ""})
    assert "NCCL_SOCKET_IFNAME" not in env


def test_the_data_interface_is_the_one_routing_to_the_group_address():
    from dpnb.engine.group.netplan import data_interface

    assert data_interface("127.0.0.1") == "lo"


def test_an_nccl_cluster_gives_cpu_tensors_gloo_as_torch_does_for_both_names():
    """A script's CPU collectives on an NCCL cluster (object collectives,
    checkpoint metadata) need a CPU backend in the group dpnb forms."""
    from torch.distributed.distributed_c10d import BackendConfig

    from dpnb.engine.group.netplan import group_backend

    devices = BackendConfig(group_backend("nccl")).get_device_backend_map()
    assert devices == {"cpu": "gloo", "cuda": "nccl"}
    assert group_backend("gloo") == "gloo"


def test_nothing_pinned_where_the_interface_is_unknown():
    env = backend_env({"backend": "nccl", "local_cluster": False, "ifname": ""})
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}


def test_nccl_dumps_go_to_the_private_folder_and_the_monitor_is_off(tmp_path):
    """Defect E: after an error the watchdog saw, torch's heartbeat monitor
    kills the engine later, and its dumps land in the shared /tmp."""
    env = backend_env({"backend": "nccl", "local_cluster": True}, str(tmp_path))
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_trace_rank_")
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    # gloo: no NCCL settings at all
    assert backend_env({"backend": "gloo", "local_cluster": True}, str(tmp_path)) == {
        "GLOO_SOCKET_IFNAME": "lo"}


def test_init_rank_passes_the_private_folder_to_the_nccl_settings():
    import inspect

    from dpnb.engine import setup

    assert "backend_env(info, folder)" in inspect.getsource(setup.init_rank)



def test_the_default_group_timeouts_are_torchs_own():
    """--timeout left out: torch's defaults, read from torch itself (the NCCL
    one is the C++ default, absent from a CPU build's Python)."""
    from torch.distributed import constants

    from dpnb.core.timeouts import TORCH_DEFAULT_TIMEOUT_S, default_timeout, form_timeout

    assert default_timeout("gloo") == constants.default_pg_timeout.total_seconds() == 1800.0
    if constants.default_pg_nccl_timeout is not None:
        assert default_timeout("nccl") == constants.default_pg_nccl_timeout.total_seconds()
    assert TORCH_DEFAULT_TIMEOUT_S["nccl"] == 600.0
    # forming a group never waits half an hour; a short group timeout bounds it too
    assert form_timeout(1800.0) == 60.0 and form_timeout(6.0) == 6.0

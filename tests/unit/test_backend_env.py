"""What each rank's communication libraries are told (dpnb.engine.setup.backend_env).

No GPU here: these are the settings the NCCL path gets, checked as a plan.
"""

from dpnb.engine.netplan import backend_env


def test_local_gloo_stays_on_loopback():
    assert backend_env({"backend": "gloo", "local_cluster": True}) == {"GLOO_SOCKET_IFNAME": "lo"}


def test_nccl_across_hosts_pins_both_interfaces_and_survives_a_slow_op():
    env = backend_env({"backend": "nccl", "local_cluster": False, "ifname": "ib0"})
    assert env == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0",
                   "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def test_nothing_pinned_where_the_interface_is_unknown():
    env = backend_env({"backend": "nccl", "local_cluster": False, "ifname": ""})
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


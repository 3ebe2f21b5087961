"""The sidebar's Start: what ``POST /api/dpnb/clusters/start`` accepts, checked as ``%dp start`` checks.

Nothing starts here: :func:`dpnb.lab.start.checked` turns a request's body
into :meth:`dpnb.Cluster.start`'s arguments, or refuses it with one line
(the server answers 400 with it) before any process exists.
"""

import pytest

from dpnb.lab import start as st


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("DPNB_STATE_DIR", str(tmp_path / "kept"))  # --keep's record folder


def test_a_local_start_becomes_a_kept_cluster_of_n_ranks():
    assert st.checked({"n": 2, "launcher": "local"}) == {
        "n": 2, "backend": "auto", "engines": "local", "launcher_args": [], "keep": "1h"}
    assert st.checked({"n": 3, "keep": "10m"})["keep"] == "10m"


@pytest.mark.parametrize("body, says", [
    ([2], "give a JSON object"),
    ({"n": 2, "ranks": 2}, "unknown setting 'ranks'"),
    ({"n": 0}, "-n must be a whole number of engines >= 1"),
    ({"n": "2"}, "-n must be a whole number"),
    ({"n": 2, "launcher": "pbs"}, "unknown launcher 'pbs'"),
    ({"n": 2, "backend": "mpi"}, "unknown backend 'mpi'"),
    ({"n": 2, "keep": "soon"}, "is not a time to live"),
    # ssh hosts: the HOST=N counts %dp start checks against -n
    ({"n": 2, "launcher": "ssh"}, "needs the hosts"),
    ({"n": 2, "launcher": "ssh", "hosts": "a=1 b=2"}, "-n 2 but the hosts take 3 engines"),
    ({"n": 2, "launcher": "ssh", "hosts": "a=two"}, "for ssh give HOST=N"),
    ({"n": 2, "launcher": "slurm", "slurm": {"partition": "gpu"}}, "slurm takes account"),
    ({"n": 2, "launcher": "slurm", "slurm": "gpu"}, "slurm: give an object"),
])
def test_bad_input_is_refused_in_one_line_before_anything_starts(body, says):
    with pytest.raises(st.StartRequestError) as e:
        st.checked(body)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_good_ssh_and_slurm_profiles_are_answered_with_the_line_the_notebook_runs(monkeypatch):
    """ssh agents and Slurm jobs are held by the starting process's connections, so
    the panel starts them in the notebook's kernel: nothing starts here, the
    answer is the checked ``%dp start`` line; asked to keep one, it says why not."""
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)  # an ssh client here
    out = st.start({"n": 3, "launcher": "ssh", "hosts": ["a=1", "b=2"], "backend": "gloo"})
    assert out["in_kernel"] and out["code"] == (
        "%dp start -n 3 --engines ssh --backend gloo --launcher-arg a=1 --launcher-arg b=2")
    out = st.start({"n": 2, "launcher": "slurm", "slurm": {"queue": "gpu", "timelimit": "1:00:00"}})
    assert out["code"] == ("%dp start -n 2 --engines slurm --launcher-arg queue=gpu "
                           "--launcher-arg timelimit=1:00:00"), out
    with pytest.raises(st.StartRequestError, match="a kept cluster takes local engines: leave keep out"):
        st.checked({"n": 2, "launcher": "ssh", "hosts": "a=2", "keep": "1h"})

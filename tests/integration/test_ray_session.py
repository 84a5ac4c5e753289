"""`ray_session`: Ray's driver-side logging and cluster messages go to <log_dir>/ray.log, not the console, and
everything is put back afterwards; a cluster it did not start is left running."""

import logging

from pipelines.ray_session import RAY_LOG, ray_session


def test_ray_output_goes_to_the_log_file_and_is_restored(ray_cluster, tmp_path, capfd):
    import ray.serve  # noqa: F401  (sets up its logger's console handler on import)
    from ray._private import worker

    serve_before = list(logging.getLogger("ray.serve").handlers)
    ray_before = list(logging.getLogger("ray").handlers)
    printer = worker.print_to_stdstream
    with ray_session(tmp_path) as started:
        logging.getLogger("ray.serve").info("serve line 1")  # Ray Serve's logger has a console handler of its own
        logging.getLogger("ray.data").warning("data line 2")
        worker.print_to_stdstream({"lines": ["raylet line 3"], "pid": "raylet", "is_err": False}, False)
    out, err = capfd.readouterr()
    assert started is False and ray_cluster.is_initialized()
    assert "Ray's log: " + str(tmp_path / RAY_LOG) in out
    for line in ("serve line 1", "data line 2", "raylet line 3"):
        assert line not in out and line not in err
    logged = (tmp_path / RAY_LOG).read_text()
    assert "serve line 1" in logged and "data line 2" in logged and "(raylet) raylet line 3" in logged
    assert logging.getLogger("ray.serve").handlers == serve_before and logging.getLogger("ray").handlers == ray_before
    assert worker.print_to_stdstream is printer


def test_dashboard_port_never_takes_a_port_ray_reserves(monkeypatch):
    """Ray refuses to start when the dashboard's port is its agent's default (52365): skip Ray's fixed ports."""
    from pipelines import ray_session

    ports = iter([52365, 8265, 6379, 40123])
    monkeypatch.setattr(ray_session, "free_port", lambda: next(ports))
    assert ray_session.dashboard_port() == 40123

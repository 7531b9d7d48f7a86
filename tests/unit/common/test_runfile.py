"""common/runfile.py: the services' machine-readable status."""
from rlstream.common.runfile import read_run_file, started, stopped, write_run_file


def test_start_then_stop_merges_and_a_new_incarnation_starts_fresh(tmp_path):
    path = tmp_path / "run" / "consumer.json"
    assert read_run_file(path) is None
    write_run_file(None, state="ignored")  # no path configured: nothing happens
    write_run_file(path, fresh=True, **started("consumer", "http://127.0.0.1:1", "127.0.0.1:9092", step=0))
    write_run_file(path, **stopped(outcomes={"trained": 8}, step=2))
    got = read_run_file(path)
    assert got["state"] == "stopped" and got["http_url"] == "http://127.0.0.1:1"
    assert got["outcomes"] == {"trained": 8} and got["step"] == 2 and got["role"] == "consumer"
    write_run_file(path, fresh=True, **started("consumer", "http://127.0.0.1:2", "b:1"))
    again = read_run_file(path)
    assert again["state"] == "running" and "outcomes" not in again and again["http_url"].endswith(":2")
    assert [p.name for p in path.parent.iterdir()] == ["consumer.json"]  # no temporary file left behind

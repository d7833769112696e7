"""`kvcache bench transfer` runs end to end (tiny sizes) and reports every transport; figures are not asserted."""

import json
import subprocess
import sys

import pytest

from kvcache.bench.transfer import ratios, rotated_order

TINY = ["--batches", "3", "--warmup", "1", "--pages-per-batch", "3", "--page-bytes", "5000", "--json"]


def _bench(*args: str, prelude: str = "pass", timeout: float = 120) -> subprocess.CompletedProcess:
    code = f"import sys; {prelude}; from kvcache.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "bench", "transfer", *args],
                          capture_output=True, text=True, timeout=timeout)


def _check_measured(figures: dict) -> None:
    for op in ("get", "put"):
        assert figures[op]["gb_per_s"] > 0 and 0 < figures[op]["p50_ms"] <= figures[op]["p99_ms"]
        assert figures[op]["batches"] == 3


def test_short_run_reports_every_transport_and_both_kvnode_paths():
    result = _bench(*TINY)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["page_bytes"] == 5000 and report["batch_bytes"] == 15000
    assert report["options"]["pages_per_batch"] == 3 and report["machine"]["cpus"] >= 1
    transports = report["transports"]
    assert set(transports) == {"kvnode", "kvnode_grpc", "redis", "socket"}
    _check_measured(transports["kvnode"])
    _check_measured(transports["kvnode_grpc"])
    _check_measured(transports["socket"])
    redis = transports["redis"]
    if "missing" in redis:  # measured where redis-server and redis-py are installed, else said so
        assert "make bench-deps" in redis["missing"]
        assert report["ratios"]["get"]["kvnode/redis"] is None
    else:
        _check_measured(redis)
        assert report["versions"]["redis_server"]
        get = report["ratios"]["get"]
        assert get["kvnode/redis"] == pytest.approx(
            transports["kvnode"]["get"]["gb_per_s"] / redis["get"]["gb_per_s"])
    assert report["ratios"]["put"]["kvnode/socket"] == pytest.approx(
        transports["kvnode"]["put"]["gb_per_s"] / transports["socket"]["put"]["gb_per_s"])


def test_missing_redis_server_is_a_row_that_says_so():
    result = _bench(*TINY[:-1], "--redis-server", "no-such-redis-server-here")
    assert result.returncode == 0, result.stderr
    redis_lines = [line for line in result.stdout.splitlines() if line.split()[1:2] == ["redis"]]
    assert len(redis_lines) == 2  # one for get, one for put: the rows stay, with the reason
    for line in redis_lines:
        assert "no-such-redis-server-here not installed: run make bench-deps" in line
    assert "kvnode data plane" in result.stdout and "kvnode gRPC" in result.stdout and "raw socket" in result.stdout


def test_plot_without_matplotlib_is_one_clear_error(tmp_path):
    result = _bench(*TINY, "--plot", str(tmp_path), prelude="sys.modules['matplotlib'] = None")
    assert result.returncode == 2
    assert "kvcache bench transfer: error: --plot: matplotlib is not installed" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is in the optional bench extra")
    result = _bench(*TINY, "--redis-server", "no-such-redis-server-here", "--plot", str(tmp_path / "charts"))
    assert result.returncode == 0, result.stderr
    png = tmp_path / "charts" / "transfer_gbps.png"
    assert json.loads(result.stdout)["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("bad", [["--batches", "0"], ["--page-bytes", "-1"], ["--warmup", "-2"]])
def test_bad_options_are_one_error_line(bad):
    result = _bench(*bad)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "kvcache bench transfer: error:" in result.stderr
    assert "Traceback" not in result.stderr


def test_ratios_divide_gb_per_s_and_leave_missing_baselines_empty():
    transports = {
        "kvnode": {"get": {"gb_per_s": 2.0}, "put": {"gb_per_s": 1.0}},
        "redis": {"missing": "redis-server not installed"},
        "socket": {"get": {"gb_per_s": 4.0}, "put": {"gb_per_s": 4.0}},
    }
    found = ratios(transports)
    assert found["get"]["kvnode/socket"] == 0.5 and found["put"]["kvnode/socket"] == 0.25
    assert found["get"]["kvnode/redis"] is None and found["get"]["redis/socket"] is None
    assert found["get"]["socket/redis"] is None


def test_rotation_puts_each_transport_in_each_place_equally_often():
    names = ["kvnode", "redis", "socket"]
    rounds = [rotated_order(names, i) for i in range(6)]
    for order in rounds:
        assert [op for _, op in order] == ["get"] * 3 + ["put"] * 3
        assert sorted(t for t, _ in order[:3]) == names and [t for t, _ in order[3:]] == [t for t, _ in order[:3]]
    for place in range(3):
        assert sorted(order[place][0] for order in rounds) == sorted(names * 2)
    assert rotated_order(["kvnode", "socket"], 1) == [("socket", "get"), ("kvnode", "get"), ("socket", "put"), ("kvnode", "put")]


def test_tls_adds_a_row_for_the_data_plane_over_mutual_tls_and_its_ratio_to_plaintext():
    result = _bench(*TINY, "--tls", "--redis-server", "no-such-redis-server-here")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    _check_measured(report["transports"]["kvnode_tls"])
    # Both over TCP, as between hosts: not the node's same-host Unix socket, which TLS and plaintext would not share.
    assert report["data_plane_wire"] == {"kvnode": "tcp", "kvnode_tls": "tcp"}
    for op in ("get", "put"):
        assert report["ratios"][op]["kvnode_tls/kvnode"] == pytest.approx(
            report["transports"]["kvnode_tls"][op]["gb_per_s"] / report["transports"]["kvnode"][op]["gb_per_s"])

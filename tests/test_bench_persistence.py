"""`kvcache bench persistence` runs end to end (tiny sizes) and reports both sides; figures are not asserted."""

import json
import subprocess
import sys


def test_bench_persistence_short_run_reports_fetch_under_both_disk_checks_and_restart(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "persistence", "--page-bytes", "4096", "--fetch-size", "1MiB",
         "--restart-size", "1MiB", "--rounds", "1", "--dir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["fetch"]["pages"] == 256
    assert min(report["fetch"][path] for path in ("plain_read", "disk_tier", "disk_tier_always", "ram_tier",
                                                  "data_plane_disk", "data_plane_ram")) > 0
    assert report["fetch"]["disk_check"] == "start", "the node's default check is the one measured first"
    assert min(report["fetch"][f"{path}_cpu_us"] for path in ("plain_read", "disk_tier", "disk_tier_always")) > 0
    assert min(report["fetch"][f"{path}_paired_ratio"] for path in ("disk_tier", "disk_tier_always")) > 0
    assert report["restart"]["pages"] == 256 and report["restart"]["node_serving_s"] > 0
    assert list(tmp_path.iterdir()) == [], "the bench removes its data dir"


def test_bench_persistence_tables_name_the_disk_check_of_each_row(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "persistence", "--page-bytes", "4096", "--fetch-size", "256KiB",
         "--restart-size", "256KiB", "--rounds", "2", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "disk_tier (--disk-check start, default)" in result.stdout
    assert "disk_tier (--disk-check always)" in result.stdout

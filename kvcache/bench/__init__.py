"""`kvcache bench`: benchmarks that report ratios against a baseline measured in the same run."""

"""The load generator behind bench/serving.py: workloads, the streaming client, the load, the metrics."""

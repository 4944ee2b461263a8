"""Admission control: per-engine caps and the FIFO queue in front of the pools, and per-client token buckets."""

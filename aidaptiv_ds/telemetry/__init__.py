"""Telemetry: process-wide I/O counters, NVML, host facts from /proc and /sys, per-step metrics."""

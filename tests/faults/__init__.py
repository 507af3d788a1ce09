"""Fault injection: real processes, real signals, real files (see docs/reliability.md)."""

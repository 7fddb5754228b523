"""Throwaway PostgreSQL servers for the test suite, the benchmarks and ``applier demo``; never used by replication.

``clusters`` finds PostgreSQL installs and runs short-lived loopback clusters from them; ``demo`` is the body of
``applier demo`` on top of them. Nothing in the product's core (decoder, engine, source, targets, migrate) imports
this package: it sits beside the core, not under it.
"""

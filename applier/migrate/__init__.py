"""The migration workflow: copy the published tables, then follow, verify, cut over.

- ``sync``: the slot with an exported snapshot, the target tables, the copy, the consistent point
  recorded as the applied position (``applier sync``);
- ``schema``: the published tables as the source catalog describes them, and the target's DDL;
- ``spark``: the bulk jobs on Apache Spark (ctid-range copy, per-range verification) and the
  ``verify`` orchestration behind ``applier verify``.

Imports run one way: the CLI → ``sync`` → ``spark`` → ``schema`` → targets, sources, engine.
"""

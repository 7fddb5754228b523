"""Schema changes as data: the shape of a source table (``shape``) and the changes between two shapes (``changes``).

Nothing here touches a database: the decoder hands the engine DDL capture's messages (``applier.source.capture``),
``shape`` reads them, ``changes`` compares the shape a replica knows with the new one, and each target kind writes the
changes in its own DDL (``applier.targets.<kind>.ddl``).
"""

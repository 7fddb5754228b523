"""The SQLite target kind: its engine target (``target``), claim, naming rule, value mapping and ``Backend``
(``backend``)."""

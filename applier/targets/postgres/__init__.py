"""The PostgreSQL target kind: its engine target (``target``), claim, naming rule and ``Backend`` (``backend``)."""

"""The user's process (the one that starts the query and runs foreachBatch), or the Connect server for it:
``verdicts`` (``reject`` / ``release``), ``client`` (finding a query's tracker, ``status``), ``listener``
(the StreamingQueryListener). The public names are re-exported by ``spark_share``.
"""

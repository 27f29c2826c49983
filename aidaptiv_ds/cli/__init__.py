"""The ``aidaptiv-ds`` command line: one module per subcommand, registered in :mod:`aidaptiv_ds.cli.main`."""

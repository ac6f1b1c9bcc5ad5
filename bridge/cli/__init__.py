"""The ``pollbridge`` command line."""

"""Imported last by the test fork server (tests/distributed.py), after the modules it preloads:
their objects move to the collector's permanent generation, so a rank's garbage collections
(initialize runs one for a pipeline) neither scan them nor copy their pages from the server."""

import gc

gc.freeze()

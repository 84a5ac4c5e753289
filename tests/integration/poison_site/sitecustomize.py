"""Imported by Python at the start of every process with this folder on its path (tests/integration/poison.py):
poisons the engine processes (and only them) of a test that set MBD_TEST_POISON."""

import os

if os.environ.get("MBD_TEST_POISON") and os.environ.get("MBD_ENGINE_FD"):
    from tests.integration.poison import install

    install()

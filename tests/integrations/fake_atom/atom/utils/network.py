"""FAKE ``atom.utils.network``."""

import os


def get_ip() -> str:
    return os.environ.get("ATOM_HOST_IP", "127.0.0.1")

"""The bearer key: where it comes from, and the constant-time check of a request's Authorization header.

The key is read from `--api-key-file F` (through the border reader; surrounding whitespace stripped) or
the environment variable MAMBA3LITE_API_KEY. With a key, every endpoint but /health requires
`Authorization: Bearer KEY`; a missing or wrong key is 401. Without one, binding an address other than
loopback is refused unless `--insecure-no-auth` says so on purpose.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

from mamba3lite import intake
from mamba3lite.errors import ConfigError

ENV_VAR = "MAMBA3LITE_API_KEY"
KEY_FILE = intake.FileKind("API key file", 64 * 1024, ConfigError, "write the key on one line")


def load_api_key(key_file: str | None) -> str | None:
    """The key from `key_file`, else from MAMBA3LITE_API_KEY, else None; ConfigError for an empty one."""
    if key_file is not None:
        key = intake.read_text_capped(key_file, KEY_FILE).strip()
        if not key:
            raise ConfigError(f"--api-key-file {key_file} is empty; write the key on one line")
        return key
    key = os.environ.get(ENV_VAR, "").strip()
    return key or None


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) only listens on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, key: str | None, insecure_no_auth: bool) -> None:
    """ConfigError when `host` is reachable from other machines and no key protects it."""
    if key is None and not insecure_no_auth and not is_loopback(host):
        raise ConfigError(
            f"--host {host} is reachable from other machines and no API key is set; set one with "
            f"--api-key-file F or {ENV_VAR}, or pass --insecure-no-auth to serve without one"
        )


def authorized(header: str | None, key: str | None) -> bool:
    """Whether an Authorization header value carries `key` (always True without a key). Constant time
    in the key's content (hmac.compare_digest)."""
    if key is None:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), key.encode())

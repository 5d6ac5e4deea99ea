"""CURVE key files (`mlxd keys generate`), read alike by the gateway and the workers."""

from __future__ import annotations

import os

import zmq.auth


def load_secret_key(path: str) -> tuple[bytes, bytes]:
    """The (public, secret) pair of a .key_secret file; ValueError saying why
    not: it cannot be read, holds no secret key, or other users may read it
    (and so pass for this side of the link, as ssh refuses such a key)."""
    try:
        mode = os.stat(path).st_mode
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the CURVE keys: {e}") from None
    if secret is None:
        raise ValueError(f"{path} holds no secret key (use the .key_secret file)")
    if mode & 0o077:
        raise ValueError(f"{path} may be read by other users, who could pass for this side with it: "
                         f"make it this user's alone (chmod 600 {path})")
    return public, secret

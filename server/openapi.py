"""The OpenAPI document served at /openapi.json (owned by this module; see `install_openapi`)."""

from __future__ import annotations

from fastapi import FastAPI


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` return this server's OpenAPI document."""

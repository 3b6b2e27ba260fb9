"""The connection options of `specserve serve` (--header-timeout, --body-timeout, --stream-stall-timeout):
their defaults, environment variables and 0 = off, down to the protocol class uvicorn is given."""

from __future__ import annotations

from specserve.server import cli
from specserve.server.connection import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                         DEFAULT_STREAM_STALL_TIMEOUT_S, ConnectionLimits, GuardedH11Protocol)
from specserve.server.launcher import build_server


def _serve_args(monkeypatch, argv=(), env=None):
    for name in cli.ENV_VARS.values():
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    return cli.build_parser().parse_args(["serve", *argv])


def test_defaults_are_the_launchers(monkeypatch):
    args = _serve_args(monkeypatch)
    assert (args.header_timeout, args.body_timeout, args.stream_stall_timeout) == (
        DEFAULT_HEADER_TIMEOUT_S, DEFAULT_BODY_TIMEOUT_S, DEFAULT_STREAM_STALL_TIMEOUT_S)
    assert ConnectionLimits() == ConnectionLimits(DEFAULT_HEADER_TIMEOUT_S, DEFAULT_BODY_TIMEOUT_S,
                                                  DEFAULT_STREAM_STALL_TIMEOUT_S)


def test_flags_and_environment(monkeypatch):
    args = _serve_args(monkeypatch, ["--header-timeout", "5"],
                       {"SPECSERVE_HEADER_TIMEOUT": "7", "SPECSERVE_BODY_TIMEOUT": "9",
                        "SPECSERVE_STREAM_STALL_TIMEOUT": "0"})
    assert (args.header_timeout, args.body_timeout, args.stream_stall_timeout) == (5.0, 9.0, 0.0)


def test_help_lists_them(capsys):
    try:
        cli.build_parser().parse_args(["serve", "--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    for flag, env in (("--header-timeout", "SPECSERVE_HEADER_TIMEOUT"), ("--body-timeout", "SPECSERVE_BODY_TIMEOUT"),
                      ("--stream-stall-timeout", "SPECSERVE_STREAM_STALL_TIMEOUT")):
        assert flag in out and env in out


def test_build_server_gives_uvicorn_the_guarded_protocol():
    server = build_server(object(), header_timeout=3.0, body_timeout=None, stream_stall_timeout=4.0)
    protocol = server.config.http
    assert issubclass(protocol, GuardedH11Protocol)
    assert protocol.limits == ConnectionLimits(header_timeout=3.0, body_timeout=None, stall_timeout=4.0)

"""Constraint compiles tried first in a child process, where a crash or a runaway fails one request.

llguidance is native code fed the client's schema or grammar; a deep enough input overflows its
stack (a segfault takes the whole process) and some inputs compile for a minute. So before the
engine compiles a constraint itself, a child process (`python -m specserve.engine.grammar_sandbox`,
llguidance and this package's torch-free `constraints` only) compiles it with the same tokenizer
and the same large stack, and computes its first mask: the answer is None (it compiles; the
engine's compile, deterministic, then does too) or the error to give the client. The child runs
under an address-space limit and a lower CPU priority; past `timeout` seconds of its CPU time on
one compile (or six times that of wall time) it is killed. A
crashed or killed child is replaced on the next compile; one that grew past `max_rss` after a
compile is replaced too, so a heavy constraint's memory goes back to the system.

`Sandbox` is one child with one compile at a time; `Grammars` (engine/grammar.py) keeps two, a
lane for small constraints and one for large ones, so a queue of heavy compiles never holds up a
small one.

Protocol: one JSON line each way. The first line down is the tokenizer (`{"tokenizer", "n_vocab",
"eos"}`), answered `{"ready": true}`; then `{"kind", "text"}` lines, each answered
`{"error": str | null, "seconds": float}`.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

logger = logging.getLogger("specserve.engine")

STACK_BYTES = 512 * 1024 * 1024      # the compile threads' stack (here and in the child): virtual until used
DEFAULT_TIMEOUT = 10.0               # seconds a compile may take in the child
DEFAULT_MEMORY = 4 * 1024 ** 3       # the child's address-space limit
DEFAULT_MAX_RSS = 768 * 1024 ** 2    # a child holding more than this after a compile is replaced
START_TIMEOUT = 60.0                 # seconds the child may take to read the tokenizer
EXIT_WAIT_S = 1.0                    # how long a child whose answer never came may take to show its exit status
CPU_POLL_S = 0.25                    # how often a compile's CPU time is read while it runs
WALL_FACTOR = 6                      # a compile's wall-clock limit, in compile timeouts (its CPU time is the limit)


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used; 0 where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


@contextmanager
def large_stack(size: int = STACK_BYTES):
    """Threads started inside get a `size`-byte stack (threading.stack_size is process-wide)."""
    old = threading.stack_size(size)
    try:
        yield
    finally:
        threading.stack_size(old)


class Sandbox:
    """One child process compiling constraints; `check` is thread-safe (one compile at a time)."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: list[int], *, timeout: float = DEFAULT_TIMEOUT,
                 memory: int = DEFAULT_MEMORY, max_rss: int = DEFAULT_MAX_RSS, stack: int = STACK_BYTES,
                 name: str = "grammar"):
        self._init = json.dumps({"tokenizer": tokenizer_json, "n_vocab": n_vocab, "eos": list(eos),
                                 "memory": memory, "stack": stack}) + "\n"
        self.timeout, self.max_rss, self.name = timeout, max_rss, name
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.num_restarts = 0

    def check(self, kind: str, text: str) -> str | None:
        """None if (kind, text) compiles in the child, else the message for the client."""
        with self._lock:
            try:
                proc = self._started()
            except RuntimeError as exc:
                return str(exc)
            try:
                proc.stdin.write(json.dumps({"kind": kind, "text": text}) + "\n")
                proc.stdin.flush()
                line = self._read(proc, self.timeout, cpu=True)
            except BrokenPipeError:
                line = None
            if line is None:
                return self._lost(proc, kind)
            answer = json.loads(line)
            if self._rss(proc) > self.max_rss:
                logger.info("the %s compile sandbox holds more than %d MiB; replacing it", self.name,
                            self.max_rss >> 20)
                self._stop(proc)
            return answer["error"]

    def _started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.engine.grammar_sandbox"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1 << 16,
            start_new_session=True)   # a signal to the server's process group is the server's to handle
        proc.stdin.write(self._init)
        proc.stdin.flush()
        line = self._read(proc, START_TIMEOUT)
        if line is None or not json.loads(line).get("ready"):
            self._stop(proc)
            raise RuntimeError("the grammar compiler could not be started on this server")
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen, timeout: float, cpu: bool = False) -> str | None:
        """The child's next line, None if it died or took longer than `timeout` seconds: of wall
        time, or with `cpu` of the child's CPU time (a compile on a loaded machine, where the child's
        lower priority leaves it little CPU, is not cut short), within WALL_FACTOR times that of wall."""
        start, used0 = time.monotonic(), _cpu_seconds(proc.pid) if cpu else 0.0
        while True:
            elapsed = time.monotonic() - start
            wait = min(timeout - elapsed if elapsed < timeout else CPU_POLL_S, CPU_POLL_S) if cpu else timeout
            ready, _, _ = select.select([proc.stdout], [], [], wait)
            if ready:
                return proc.stdout.readline() or None
            elapsed = time.monotonic() - start
            if not cpu or elapsed >= WALL_FACTOR * timeout or proc.poll() is not None:
                return None
            if elapsed >= timeout and _cpu_seconds(proc.pid) - used0 >= timeout:
                return None

    def _lost(self, proc: subprocess.Popen, kind: str) -> str:
        """The child died on a compile or ran past the timeout: kill it, say which."""
        try:   # its stdout closes a moment before its exit status can be read
            code = proc.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        self._stop(proc)
        self.num_restarts += 1
        if code is None:
            logger.warning("a %s constraint ran past its compile timeout (%.0f s); the sandbox was killed", kind,
                           self.timeout)
            return f"the {kind} constraint did not compile within {self.timeout:g} s; simplify it"
        reason = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        logger.warning("the grammar compiler died on a %s constraint (%s); the request got a 400", kind, reason)
        return (f"the {kind} constraint could not be compiled: the grammar compiler failed on it ({reason}); "
                f"simplify it")

    @staticmethod
    def _rss(proc: subprocess.Popen) -> int:
        try:
            with open(f"/proc/{proc.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def _stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        if self._proc is proc:
            self._proc = None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._stop(self._proc)


# ---- the child ---------------------------------------------------------------------------------


def _compile(llguidance, tokenizer, kind: str, text: str) -> str | None:
    from specserve.engine.constraints import grammar_text

    try:
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(kind, text), log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()       # a grammar with no way to start fails here (a $ref cycle)
        if matcher.is_error():
            return compile_error(kind, matcher.get_error())
    except Exception as exc:   # noqa: BLE001 - llguidance raises plain exceptions for what it cannot read
        return compile_error(kind, str(exc))
    return None


def compile_error(kind: str, error: str) -> str:
    """llguidance's error as a client's message: its first line (the rest is parser state or a Rust
    backtrace), cut to a readable length."""
    first = (error or "unknown error").strip().splitlines()[0].strip()
    if len(first) > 400:
        first = first[:400] + "..."
    return f"the {kind} constraint does not compile: {first}"


def _child() -> None:
    import resource

    init = json.loads(sys.stdin.readline())
    resource.setrlimit(resource.RLIMIT_AS, (init["memory"], init["memory"]))
    os.nice(10)
    import llguidance

    tokenizer = llguidance.LLTokenizer(init["tokenizer"], n_vocab=init["n_vocab"], eos_token=init["eos"])
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        result: list = []
        with large_stack(init["stack"]):
            worker = threading.Thread(target=lambda: result.append(_compile(llguidance, tokenizer, job["kind"],
                                                                            job["text"])))
            worker.start()
        worker.join()
        out.write(json.dumps({"error": result[0] if result else "the compile raised",
                              "seconds": time.perf_counter() - t0}) + "\n")
        out.flush()


if __name__ == "__main__":
    _child()

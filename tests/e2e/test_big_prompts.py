"""Big bodies hold nobody: a prompt that cannot fit the context is refused before it is templated or
tokenized, so four near-limit bodies in flight leave a small chat fast and the server's memory
flat; the default body limit follows the context length."""

from __future__ import annotations

import threading
import time

import httpx

SMALL = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def rss_bytes() -> int:
    """Resident memory of this process (the server runs in a thread of it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def big_bodies_and_a_small_chat(server, content_bytes: int) -> tuple[list[httpx.Response], float, int]:
    """Four chats of `content_bytes` of text sent at once, and a small chat sent while they are in
    flight: (the four answers, the small chat's seconds, the peak RSS growth over the run)."""
    body = ('{"messages":[{"role":"user","content":"' + "a " * (content_bytes // 2) + '"}]}').encode()
    answers: list[httpx.Response] = []
    base, peak, done = rss_bytes(), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes() - base)
            time.sleep(0.01)

    def send():
        answers.append(httpx.post(server.v1 + "/chat/completions", content=body, timeout=120,
                                  headers={"content-type": "application/json"}))

    watcher = threading.Thread(target=watch)
    watcher.start()
    senders = [threading.Thread(target=send) for _ in range(4)]
    for t in senders:
        t.start()
    time.sleep(0.3)                      # the big bodies are on their way in
    t0 = time.monotonic()
    small = httpx.post(server.v1 + "/chat/completions", json=SMALL, timeout=120)
    small_s = time.monotonic() - t0
    assert small.status_code == 200, small.text
    for t in senders:
        t.join(120)
    done.set()
    watcher.join()
    return answers, small_s, peak[0]


def test_four_near_limit_bodies_hold_nobody(serve, make_tiny_engine):
    """Bodies just under the old 8 MiB default (~3.9 M tokens of text against a 512-token context):
    each used to be templated and tokenized whole (seconds and gigabytes each), four at once filling
    the tokenizer threads while a 4-token chat waited."""
    with serve(make_tiny_engine(), max_request_body_bytes=8 * 2**20) as server:
        answers, small_s, peak = big_bodies_and_a_small_chat(server, 7_800_000)
    assert [r.status_code for r in answers] == [400] * 4
    assert all(r.json()["error"]["code"] == "context_length_exceeded" for r in answers)
    assert "at least" in answers[0].json()["error"]["message"]
    assert small_s < 2.0, small_s
    assert peak < 600 * 2**20, peak / 2**20           # four 7.8 MB bodies, not gigabytes of tokens


def test_the_default_body_limit_follows_the_context(serve, make_tiny_engine):
    """The tiny model's 512-token context gets the 1 MiB floor: a bigger body is a 413 before it is
    parsed, one under it whose text cannot fit is a 400 before it is tokenized."""
    with serve(make_tiny_engine()) as server:
        answers, small_s, _ = big_bodies_and_a_small_chat(server, 1_200_000)
        assert [r.status_code for r in answers] == [413] * 4
        assert "1048576 bytes" in answers[0].json()["error"]["message"]
        answers, _, _ = big_bodies_and_a_small_chat(server, 1_000_000)
        assert [r.status_code for r in answers] == [400] * 4
        assert small_s < 2.0
        r = httpx.post(server.v1 + "/completions", json={"prompt": "a " * 3000, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"

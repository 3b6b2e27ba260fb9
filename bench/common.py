"""Helpers shared by the benchmark runners: prompt encoding, the transformers reference model and its
`generate` loop, and a description of the machine a measurement ran on."""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch


def chat_ids(tokenizer, text: str) -> list[int]:
    """`text` as one user turn in the model's chat template (plain encoding when it has none)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(text, add_special_tokens=True)
    # as the server does: render the template, then encode (transformers 4 and 5 agree on this form)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def build_hf_model(loaded, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The transformers model of a `LoadedModel` (same weights as our engine), in eval mode."""
    import transformers

    archs = loaded.hf_config.architectures
    hf_cls = getattr(transformers, archs[0]) if archs else transformers.LlamaForCausalLM
    hf = hf_cls(loaded.hf_config)
    hf.load_state_dict(loaded.state_dict, strict=False)
    hf.tie_weights()
    return hf.to(device=device, dtype=dtype).eval()


def run_hf(hf, prompts: list[list[int]], max_tokens: int, *, temperature: float = 0.0,
           seeds: list[int] | None = None, prompt_lookup_num_tokens: int | None = None,
           pad_token_id: int = 0) -> tuple[int, float, list[list[int]]]:
    """transformers `generate`, one prompt at a time, exactly `max_tokens` new tokens each (EOS
    suppressed by `min_new_tokens`). Sampling (temperature > 0) is seeded per prompt from `seeds`
    and uses no top-k/top-p filter. Returns (new tokens, seconds, new token ids per prompt)."""
    outs, total, elapsed = [], 0, 0.0
    kwargs: dict = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad_token_id)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device=hf.device)
        if temperature > 0:
            torch.manual_seed(seeds[i] if seeds else i)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        new = out[0, len(p):].tolist()
        elapsed += time.perf_counter() - t0
        total += len(new)
        outs.append(new)
    return total, elapsed, outs


def cpu_model() -> tuple[str | None, str | None]:
    """(the CPU's model name, its widest vector instructions: "AVX-512 (VNNI, BF16)", "AVX2", ...)
    from /proc/cpuinfo; (None, None) where there is none. The same GGUF decodes several times
    faster with AVX-512 than with AVX2, so a CPU figure means little without them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, None
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags_line = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    flags = set(flags_line.group(1).split()) if flags_line else set()
    if "avx512f" in flags:
        extras = [label for flag, label in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"), ("amx_tile", "AMX"))
                  if flag in flags]
        isa = "AVX-512" + (f" ({', '.join(extras)})" if extras else "")
    elif "avx2" in flags:
        isa = "AVX2" + (" + FMA" if "fma" in flags else "")
    elif flags:
        isa = "SSE only" if "avx" not in flags else "AVX"
    else:
        isa = None
    return (name.group(1).strip() if name else None), isa


def machine_info(device: torch.device | str = "cpu") -> dict:
    """Where a measurement ran: platform, CPU (model and vector instructions), torch threads and the
    accelerator if any."""
    device = torch.device(device)
    model, isa = cpu_model()
    info = {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_model": model, "cpu_isa": isa, "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    return info


def write_result(out: str | Path, result: dict, markdown) -> str:
    """A run's result as OUT.json and its table (`markdown(result)`) as OUT.md, printed too; the table."""
    text = markdown(result)
    print(text)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(text)
    return text


def serve_command(model: str, port: int | str, drafters: list[str] | tuple[str, ...], extra: list[str]) -> list[str]:
    """The command line of our server started by a benchmark: `model` with `drafters` loaded, on
    127.0.0.1:`port`, warnings only, then `extra` arguments."""
    cmd = [sys.executable, "-m", "specserve.server", "serve", "--model", model]
    for d in drafters:
        cmd += ["--drafter", d]
    return cmd + ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 just now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedServer:
    """A server subprocess a benchmark starts (its own session, so the operator's Ctrl-C reaches only
    the benchmark, which then stops it with SIGTERM like at the end of a run): ours, or llama.cpp's
    `llama-server` (both answer GET /health with 200 once the model is loaded)."""

    def __init__(self, cmd: list[str], log_path: Path):
        self.cmd = cmd
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None
        self._log = None

    def start(self, env: dict[str, str] | None = None) -> None:
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, base: str, timeout: float) -> None:
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.alive():
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before it was ready:\n"
                                   + self.log_tail())
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    self.ready_s = time.monotonic() - t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {timeout:.0f} s:\n" + self.log_tail())

    def stop(self, timeout: float) -> dict:
        """SIGTERM, then wait up to `timeout` s (SIGKILL after); the exit status as the shell shows it."""
        if self.proc is None:
            return {"exit_status": None}
        t0 = time.monotonic()
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                killed = True
                self.proc.kill()
                self.proc.wait(30)
        seconds = time.monotonic() - t0
        if self._log is not None:
            self._log.close()
        rc = self.proc.returncode
        status = 128 - rc if rc < 0 else rc       # Popen: -N = killed by signal N; the shell says 128 + N
        return {"exit_status": status, "returncode": rc,
                "signal": signal.Signals(-rc).name if rc < 0 else None,
                "killed_after_timeout": killed, "seconds_to_exit": seconds}

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

"""llama.cpp, for `specserve bench cpu`: a worker run by the Python of an environment that has
llama-cpp-python (its own, not specserve's: it builds llama.cpp from source), so this file imports
nothing of specserve.

    LLAMA_PYTHON llama_worker.py --model MODEL.gguf --threads 2 [--n-ctx 2048] [--lookup-tokens 10]

It loads the GGUF twice, plain and with llama.cpp's prompt-lookup decoding
(`LlamaPromptLookupDecoding`), prints one JSON line {"ready": true, "version": ...}, then answers
each request line {"mode": "plain" | "lookup", "prompt": [token ids], "max_tokens": N} with
{"tokens": [N greedy token ids, EOS not stopping them], "seconds": wall time of the request,
prompt evaluation included}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--lookup-tokens", type=int, default=10, help="prompt lookup's draft length (llama-cpp-python's "
                                                                    "default)")
    args = ap.parse_args()
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def load(**extra):
        return llama_cpp.Llama(model_path=args.model, n_ctx=args.n_ctx, n_threads=args.threads,
                               n_threads_batch=args.threads, n_batch=512, seed=0, verbose=False, **extra)

    models = {"plain": load(), "lookup": load(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.lookup_tokens))}
    print(json.dumps({"ready": True, "version": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        llm = models[req["mode"]]
        llm.reset()
        tokens: list[int] = []
        start = time.perf_counter()
        for tok in llm.generate(req["prompt"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                reset=True):
            tokens.append(int(tok))
            if len(tokens) >= req["max_tokens"]:
                break
        print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

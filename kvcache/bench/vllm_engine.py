"""A vLLM engine in its own process, driven over stdin/stdout by `kvcache bench vllm` and the vLLM tests.

Run with vLLM's Python: python -m kvcache.bench.vllm_engine MODEL_DIR [KV_TRANSFER_CONFIG_JSON]. Prints "READY"
once the engine runs; then reads one JSON request a line ({"prompts": [text or token ids ...],
"max_tokens": N, "cache_salt": S}) and answers each with one "RESULT " line: per prompt its token
ids, vLLM's num_cached_tokens, its time to first token and the seconds it took. Greedy throughout;
one prompt at a time, so each time is the prompt's own.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")

# The answers get stdout to themselves: vLLM and its engine process (which inherits our descriptors)
# print to stdout too, and a line of theirs could land inside a long RESULT line.
answers = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

if __name__ == "__main__":  # vLLM spawns its engine process: the entry point must sit under this guard
    from vllm import LLM, SamplingParams

    config = json.loads(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else None
    llm = LLM(sys.argv[1], enforce_eager=True, dtype="bfloat16", max_model_len=8192, seed=0,
              kv_transfer_config=config, disable_log_stats=False)
    print("READY", file=answers, flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        params = SamplingParams(max_tokens=ask.get("max_tokens", 8), temperature=0)
        results = []
        for text in ask["prompts"]:
            prompt = {"prompt": text} if isinstance(text, str) else {"prompt_token_ids": text}
            if ask.get("cache_salt"):
                prompt["cache_salt"] = ask["cache_salt"]
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - start
            ttft = getattr(out.metrics, "first_token_latency", 0.0) or None
            results.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
                            "prompt_tokens": len(out.prompt_token_ids), "seconds": seconds, "ttft": ttft})
        print("RESULT " + json.dumps(results), file=answers, flush=True)

"""The engines beside ours on the same weights, as `splitspec bench` configurations (one stream,
one token per step, timed like the gateway's runs, interleaved with them):

* `transformers`: `generate` on the target, loaded by transformers itself (a GGUF target from its
  own file, `gguf_file=`, dequantized to f32 as transformers does);
* `llamacpp`: llama.cpp (llama-cpp-python) on a GGUF target's own file, in its native
  quantization; tokens drawn by our sampler from its logits.

Both are optional imports: a missing one skips its configuration with the reason."""
from __future__ import annotations

import time
from pathlib import Path

from splitspec.engine.sample import make_generator, sample
from splitspec.models.gguf import source_of

from .client import Sample

BASELINES = ("transformers", "llamacpp")


def unavailable(key: str, target_path: Path | None) -> str | None:
    """Why configuration `key` cannot run here, or None."""
    if target_path is None:
        return "needs --target-model-path (a local model)"
    if key == "llamacpp" and source_of(target_path) is None and target_path.suffix != ".gguf":
        return "needs a GGUF target (llama.cpp runs the file itself)"
    try:
        __import__("transformers" if key == "transformers" else "llama_cpp")
    except ImportError:
        return ("transformers is not installed (pip install transformers)" if key == "transformers" else
                "llama-cpp-python is not installed (pip install llama-cpp-python)")
    return None


def make(key: str, target_path: Path, threads: int, n_ctx: int):
    return Transformers(target_path) if key == "transformers" else LlamaCpp(target_path, threads, n_ctx)


def _sample(tokens: list[int], start: float, times: list[float]) -> Sample:
    steps = [1] * (len(tokens) - 1)
    return Sample(tokens=tokens, start_s=start, wall_s=times[-1], ttft_s=times[0], step_times=times,
                  step_sizes=steps, verify_steps=len(steps), committed=len(steps), method_ran="none")


class Transformers:
    def __init__(self, target_path: Path):
        import torch
        from transformers import AutoModelForCausalLM
        gguf = source_of(target_path) or (target_path if target_path.suffix == ".gguf" else None)
        where = dict(pretrained_model_name_or_path=gguf.parent, gguf_file=gguf.name) if gguf else \
            dict(pretrained_model_name_or_path=target_path)
        self.model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()

    def run(self, prompt_ids, max_new: int, params) -> Sample:
        import torch
        from transformers import GenerationConfig
        greedy = params.temperature == 0
        # eos ignored, as in every configuration: exactly max_new tokens each.
        config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=not greedy,
                                  eos_token_id=None, pad_token_id=0, temperature=None if greedy else params.temperature,
                                  top_p=None if greedy else params.top_p, top_k=None if greedy else (params.top_k or None))
        if params.seed is not None:
            torch.manual_seed(params.seed)
        clock = _Clock()
        ids = torch.tensor([list(prompt_ids)])
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=clock)
        return _sample(out[0, ids.shape[1]:].tolist(), clock.start, clock.times)

    def close(self) -> None:
        pass


class _Clock:
    """A transformers streamer that notes when each new token arrives (its first put is the prompt)."""

    def __init__(self):
        self.start, self.times, self._prompt = time.perf_counter(), [], True

    def put(self, value) -> None:
        if not self._prompt:
            self.times.append(time.perf_counter() - self.start)
        self._prompt = False

    def end(self) -> None:
        pass


class LlamaCpp:
    def __init__(self, target_path: Path, threads: int, n_ctx: int):
        from llama_cpp import Llama
        path = source_of(target_path) or target_path
        self.llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=512, verbose=False)

    def run(self, prompt_ids, max_new: int, params) -> Sample:
        import numpy as np
        import torch
        llm, gen = self.llm, make_generator(params.seed)
        llm.reset()
        start, times, tokens = time.perf_counter(), [], []
        llm.eval(list(prompt_ids))
        while len(tokens) < max_new:
            # The last evaluated token's logits (llama-cpp-python keeps `scores` only with logits_all).
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
            tokens.append(sample(torch.from_numpy(logits.copy()), params, gen))
            times.append(time.perf_counter() - start)
            if len(tokens) < max_new:
                llm.eval([tokens[-1]])
        return _sample(tokens, start, times)

    def close(self) -> None:
        self.llm.close()

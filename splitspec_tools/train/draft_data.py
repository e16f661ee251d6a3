"""Training data for the draft trainer: the corpus streams, and the *producer* that holds the frozen
target, regenerates the target's own continuations of training prompts (cached as token ids under
`<run-dir>/data/`) and streams each sequence with its features to the trainer; once enough exist it
replays the cached ids, recomputing features with one target forward per batch."""
from __future__ import annotations

import os
import queue as queue_mod
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from splitspec.engine.sample import SamplingParams, make_generator
from target_service import engine
from splitspec.models.config import ModelConfig

# ---------------------------------------------------------------- target, tokenizer, corpus

def load_target(path, threads: int | None = None, dtype: str = "float32", device: str = "cpu",
                tensor_parallel_size: int = 1):
    if threads:
        torch.set_num_threads(threads)
    return engine.load_model(path, dtype=dtype, device=device, tensor_parallel_size=tensor_parallel_size)


def target_tokenizer(path):
    from target_service.engine import load_tokenizer
    return load_tokenizer(path)


def eos_ids_of(target_cfg: ModelConfig, tok) -> tuple[int, ...]:
    if target_cfg.eos_token_ids:
        return tuple(target_cfg.eos_token_ids)
    idx = tok.token_to_id("<|endoftext|>") if tok is not None else None
    return (idx,) if idx is not None else ()


def corpus_streams(target_path, run_dir: Path, max_files: int | None, data: str = "code",
                   width: int = 0) -> dict[str, torch.Tensor]:
    """The training corpus (splitspec_tools.train.corpus: stdlib, held-out split by file) tokenized with
    the target's tokenizer and packed as `<eos> doc <eos> doc …`, cached in the run folder.
    data "chat": pools [N, width] of chat prompts instead (chat_data.py), for instruct targets."""
    from target_service.engine import tokenizer_hash
    cache = run_dir / "corpus.pt"
    key = {"tokenizer": tokenizer_hash(target_path), "max_files": max_files, "data": data, "width": width}
    if cache.is_file():
        streams = torch.load(cache)
        if streams.get("key") == key:
            return streams
    if data == "chat":
        from .chat_data import prompt_pool
        streams = {**prompt_pool(target_path, width, max_files=max_files), "key": key}
        torch.save(streams, cache)
        return streams
    from . import corpus
    tok = target_tokenizer(target_path)
    eos = tok.token_to_id("<|endoftext|>")
    train_docs, held_docs = corpus.load_corpus(max_files=max_files)

    def pack(docs) -> torch.Tensor:
        ids: list[int] = []
        for enc in tok.encode_batch([d.text for d in docs]):
            if eos is not None:
                ids.append(eos)
            ids.extend(enc.ids)
        return torch.tensor(ids, dtype=torch.int32)

    streams = {"train": pack(train_docs), "heldout": pack(held_docs),
               "train_files": len(train_docs), "heldout_files": len(held_docs), "key": key}
    tmp = cache.with_suffix(".tmp")
    torch.save(streams, tmp)
    os.replace(tmp, cache)
    return streams


def windows(stream: torch.Tensor, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
    if stream.dim() == 2:       # a prompt pool (chat data): random rows, each cut to its last `length` tokens
        if length > stream.shape[1]:
            raise ValueError(f"prompts of {length} tokens asked from a pool {stream.shape[1]} wide")
        rows = torch.randint(0, stream.shape[0], (n,), generator=generator)
        return stream[rows, stream.shape[1] - length:].long()
    return _stream_windows(stream, n, length, generator)


def _stream_windows(stream: torch.Tensor, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """n random windows [n, length] of a packed stream (repeats the stream if it is short)."""
    if len(stream) <= length:
        reps = length // max(len(stream), 1) + 2
        stream = stream.repeat(reps)
    starts = torch.randint(0, len(stream) - length, (n,), generator=generator)
    return torch.stack([stream[s:s + length] for s in starts.tolist()]).long()


# ---------------------------------------------------------------- the producer

@dataclass
class ProducerSpec:
    target_path: str
    run_dir: str
    layer_ids: tuple[int, ...]
    prompt_len: int
    seq_len: int
    num_chunks: int                  # generation chunks of gen_batch rows
    gen_batch: int
    replay_batch: int
    greedy_frac: float
    raw_frac: float
    temperature: float
    top_p: float
    seed: int
    threads: int
    bf16: bool
    start_item: int = 0              # items already consumed (resume): skipped without compute
    max_files: int | None = None
    data: str = "code"               # "chat": prompts from chat_data.py's pool
    pool_width: int = 0              # chat: the pool's width (the longest prompt length asked of it)
    device: str = "cpu"
    replay_kinds: str = "all"
    tp_size: int = 1                 # tensor-parallel ranks of the producer's target


def chunk_path(run_dir, k: int) -> Path:
    return Path(run_dir) / "data" / f"chunk_{k:05d}.pt"


def row_kinds(spec: ProducerSpec, k: int) -> torch.Tensor:
    """Per-row temperature of chunk k: 0 (greedy), spec.temperature, or -1 (raw corpus text)."""
    g = torch.Generator().manual_seed(spec.seed * 7_919 + k)
    u = torch.rand(spec.gen_batch, generator=g)
    kinds = torch.full((spec.gen_batch,), spec.temperature)
    kinds[u < spec.greedy_frac + spec.raw_frac] = 0.0
    kinds[u < spec.raw_frac] = -1.0
    return kinds


def _row_params(temps: torch.Tensor, top_p: float) -> list[SamplingParams]:
    return [SamplingParams(temperature=float(t), top_p=top_p if t > 0 else 1.0) for t in temps.tolist()]


@torch.inference_mode()
def regenerate(model, prompts: torch.Tensor, total_len: int, temps: torch.Tensor, top_p: float,
               generator: torch.Generator, layer_ids):
    """The target's continuations of equal-length prompts [b, P] up to total_len tokens: all rows
    in lockstep through the service's runner (`SequenceBatch`), greedy where temps == 0, else
    sampled at that temperature with top_p, each row with its own generator seeded from
    `generator`. Returns tokens [b, total_len] and the float32 features [b, total_len - 1, F] of
    every token the target ran (all but the last, not run yet)."""
    b, P = prompts.shape
    device = next(model.parameters()).device
    seeds = torch.randint(0, 2 ** 62, (b,), generator=generator).tolist()
    batch = engine.SequenceBatch(model, prompts.tolist(), _row_params(temps, top_p), max_len=total_len,
                                 generators=[make_generator(s, device) for s in seeds], hidden_layers=tuple(layer_ids))
    first = batch.prefill()
    feats = [torch.stack([o.hidden for o in first]).float()]
    for _ in range(total_len - P - 1):
        feats.append(torch.stack([o.hidden[0] for o in batch.decode()])[:, None].float())
    tokens = torch.tensor([s.tokens for s in batch.seqs], dtype=torch.long, device=prompts.device)
    return tokens, torch.cat(feats, 1)


def features_of(model, tokens: torch.Tensor, layer_ids) -> torch.Tensor:
    """Features [b, S - 1, F] of tokens [b, S] (the last token is not needed), by one forward
    through the service's path (`engine.forward_sequences`): every family gives the features it
    serves with."""
    return engine.forward_sequences(model, tokens[:, :-1], hidden_layers=tuple(layer_ids), logits=False).hidden.float()


class Producer:
    """Iterates the deterministic item schedule (generation chunks, then seeded replay epochs) and
    puts `(tokens [S], features [S-1, F], info)` items on a queue."""

    def __init__(self, spec: ProducerSpec, put, stopped):
        self.spec, self.put, self.stopped = spec, put, stopped
        self.busy = 0.0
        self.seqs = self.tokens = self.generated = 0
        self.item = 0

    def run(self) -> None:
        spec = self.spec
        torch.set_num_threads(spec.threads)
        # bf16: the weights themselves in bfloat16 (autocast would re-cast the frozen weights on
        # every call of every decode step)
        self.model = load_target(spec.target_path, dtype="bfloat16" if spec.bf16 else "float32",
                                 device=spec.device, tensor_parallel_size=spec.tp_size)
        try:
            self._produce()
        finally:
            engine.close_model(self.model)      # a tensor-parallel target's other ranks

    def _produce(self) -> None:
        spec = self.spec
        streams = corpus_streams(spec.target_path, Path(spec.run_dir), spec.max_files, spec.data, spec.pool_width)
        self.train_stream = streams["train"]
        (Path(spec.run_dir) / "data").mkdir(parents=True, exist_ok=True)
        for k in range(spec.num_chunks):
            if self.stopped():
                return
            self._chunk(k)
        epoch = 1
        while not self.stopped():
            g = torch.Generator().manual_seed(spec.seed * 104_729 + epoch)
            pairs = self._replay_rows()
            order = torch.randperm(len(pairs), generator=g).tolist()
            for i in range(0, len(order), spec.replay_batch):
                if self.stopped():
                    return
                self._replay([pairs[j] for j in order[i:i + spec.replay_batch]], epoch)
            epoch += 1

    def _kept(self, temperature: torch.Tensor) -> torch.Tensor:
        """Rows of a cached chunk that --replay-kinds uses, by the temperature it recorded per row."""
        greedy = temperature == 0
        return {"all": torch.ones_like(greedy), "greedy": greedy, "sampled": ~greedy}[self.spec.replay_kinds]

    def _replay_rows(self) -> list[tuple[int, int]]:
        """(chunk, row) of every cached row the replay epochs use."""
        spec = self.spec
        if spec.replay_kinds == "all":
            return [(k, r) for k in range(spec.num_chunks) for r in range(spec.gen_batch)]
        pairs = []
        for k in range(spec.num_chunks):
            keep = self._kept(torch.load(chunk_path(spec.run_dir, k))["temperature"])
            pairs += [(k, r) for r in keep.nonzero().flatten().tolist()]
        if not pairs:
            raise RuntimeError(f"--replay-kinds {spec.replay_kinds}: no such rows in the cached data")
        return pairs

    def _skip(self, n: int) -> bool:
        if self.item + n <= self.spec.start_item:
            self.item += n
            return True
        return False

    def _chunk(self, k: int) -> None:
        spec = self.spec
        path = chunk_path(spec.run_dir, k)
        if path.is_file():
            # cached by an earlier run: a replay already, so --replay-kinds applies
            blob = torch.load(path)
            tokens = blob["tokens"].long()[self._kept(blob["temperature"])]
            if self._skip(len(tokens)):
                return
            t0 = time.perf_counter()
            feats = features_of(self.model, tokens.to(spec.device), spec.layer_ids).cpu()
            self.busy += time.perf_counter() - t0
            self._emit(tokens, feats, {"chunk": k, "kind": "cached"})
            return
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(spec.seed * 1_000_003 + k)
        kinds = row_kinds(spec, k)
        gen_rows = (kinds >= 0).nonzero().flatten()
        raw_rows = (kinds < 0).nonzero().flatten()
        F = len(spec.layer_ids) * self.model.cfg.hidden_size
        tokens = torch.zeros(spec.gen_batch, spec.seq_len, dtype=torch.long)
        feats = torch.zeros(spec.gen_batch, spec.seq_len - 1, F)
        if len(raw_rows):
            tokens[raw_rows] = windows(self.train_stream, len(raw_rows), spec.seq_len, g)
            feats[raw_rows] = features_of(self.model, tokens[raw_rows].to(spec.device), spec.layer_ids).cpu()
        if len(gen_rows):
            prompts = windows(self.train_stream, len(gen_rows), spec.prompt_len, g)
            t, f = regenerate(self.model, prompts.to(spec.device), spec.seq_len, kinds[gen_rows].to(spec.device),
                              spec.top_p, g, spec.layer_ids)
            # items cross the process boundary as CPU tensors (no CUDA IPC); the trainer moves them
            tokens[gen_rows], feats[gen_rows] = t.cpu(), f.cpu()
        tmp = path.with_suffix(".tmp")
        torch.save({"tokens": tokens.to(torch.int32), "temperature": kinds,
                    "prompt_len": spec.prompt_len, "top_p": spec.top_p}, tmp)
        os.replace(tmp, path)
        self.busy += time.perf_counter() - t0
        self.generated += len(tokens)
        if not self._skip(len(tokens)):
            self._emit(tokens, feats, {"chunk": k, "kind": "generated"})

    def _replay(self, pairs, epoch: int) -> None:
        if self._skip(len(pairs)):
            return
        t0 = time.perf_counter()
        by_chunk: dict[int, list[int]] = {}
        for k, r in pairs:
            by_chunk.setdefault(k, []).append(r)
        loaded = {k: torch.load(chunk_path(self.spec.run_dir, k))["tokens"] for k in by_chunk}
        tokens = torch.stack([loaded[k][r] for k, r in pairs]).long()
        feats = features_of(self.model, tokens.to(self.spec.device), self.spec.layer_ids).cpu()
        self.busy += time.perf_counter() - t0
        self._emit(tokens, feats, {"chunk": -1, "kind": f"replay{epoch}"})

    def _emit(self, tokens, feats, info) -> None:
        for i in range(len(tokens)):
            if self.item < self.spec.start_item:     # resumed in the middle of a chunk
                self.item += 1
                continue
            self.seqs += 1
            self.tokens += tokens.shape[1]
            meta = dict(info, item=self.item, producer_busy_s=self.busy, producer_seqs=self.seqs,
                        producer_tokens=self.tokens, generated=self.generated)
            self.item += 1
            while not self.put((tokens[i].clone(), feats[i].clone(), meta)):
                if self.stopped():
                    return


def _producer_entry(spec: ProducerSpec, q, stop) -> None:
    """Process / thread body: run the producer, report an exception as a final item."""
    def put(item) -> bool:
        try:
            q.put(item, timeout=1.0)
            return True
        except queue_mod.Full:
            return False
    try:
        Producer(spec, put, stop.is_set).run()
    except BaseException as e:  # noqa: BLE001 - forwarded to the trainer, which raises it
        import traceback
        q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None))


class ProducerHandle:
    def __init__(self, spec: ProducerSpec, mode: str, queue_size: int):
        if mode == "process":
            import torch.multiprocessing as mp
            ctx = mp.get_context("spawn")
            self.q, self.stop = ctx.Queue(maxsize=queue_size), ctx.Event()
            # A module-level function of this module (never __main__, even under `python -m`), so the
            # spawned interpreter can import it. A daemonic process may not start the other ranks
            # of a tensor-parallel target; `close` stops a non-daemonic one.
            self.worker = ctx.Process(target=_producer_entry, args=(spec, self.q, self.stop),
                                      daemon=spec.tp_size <= 1)
        else:
            self.q, self.stop = queue_mod.Queue(maxsize=queue_size), threading.Event()
            self.worker = threading.Thread(target=_producer_entry, args=(spec, self.q, self.stop), daemon=True)
        self.worker.start()
        self.wait_s = 0.0
        self.first_s: float | None = None

    def get(self, timeout: float = 1800.0):
        t0 = time.perf_counter()
        while True:
            try:
                item = self.q.get(timeout=5.0)
                break
            except queue_mod.Empty:
                alive = self.worker.is_alive()
                if not alive or time.perf_counter() - t0 > timeout:
                    raise RuntimeError("the producer stopped without sending data"
                                       if not alive else f"no data from the producer for {timeout:.0f}s")
        if self.first_s is None:
            self.first_s = time.perf_counter() - t0     # producer start-up, reported apart
        else:
            self.wait_s += time.perf_counter() - t0
        if item[0] == "error":
            raise RuntimeError(f"producer failed: {item[1]}")
        return item

    def poll(self):
        """An item if one is ready, else None (never waits)."""
        try:
            item = self.q.get_nowait()
        except queue_mod.Empty:
            return None
        if item[0] == "error":
            raise RuntimeError(f"producer failed: {item[1]}")
        return item

    def close(self) -> None:
        self.stop.set()
        deadline = time.time() + 30
        while self.worker.is_alive() and time.time() < deadline:
            try:
                self.q.get(timeout=0.2)          # unblock a put
            except Exception:                    # noqa: BLE001 - Empty, or a tensor of a dead producer
                pass
            self.worker.join(timeout=0.1)
        if self.worker.is_alive() and hasattr(self.worker, "terminate"):
            self.worker.terminate()
            self.worker.join(timeout=5)

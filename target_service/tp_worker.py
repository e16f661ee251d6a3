"""The tensor-parallel group of one target replica: the service process is rank 0 and drives
ranks 1..N-1, which it starts itself (spawned, never forked: a forked child would inherit the
gRPC server's threads and locks).

Control and data travel apart:

* **Control** (what to run next) goes down one pipe per worker: once per batched forward,
  rank 0 pickles a small step description (token ids, positions, the attention plan's slot
  and gather indices and masks, which logits rows to compute, and the KV copies made since the
  last forward when a verify compacted an accepted tree path) and writes the same bytes to
  every worker. A worker idles in `recv` with no timeout, which is what it should do while the
  replica has no work; it sees EOF the moment rank 0 dies.
* **Data** (activations) goes through torch.distributed collectives (gloo on CPU, NCCL on
  CUDA): two all-reduces per layer, one for the embedding, one gather of the logits. The
  process group has a timeout (`--tp-timeout-s`), so no collective waits forever; a rank that
  dies closes its connections and its peers' collectives fail at once.

Only rank 0 samples, verifies, and decides which KV to keep; the workers mirror its KV writes
(through the same plan) and its copies. Block bookkeeping (which blocks a session holds)
exists only on rank 0; a worker's pool has the same block ids, with its share of the KV heads.

A worker that dies takes the replica out of service: the monitor thread marks the group
failed, every later forward raises TensorParallelError (UNAVAILABLE to the gateway, which
re-prefills elsewhere) and the server's `on_failure` hook turns health NOT_SERVING.

**Several nodes** (`--nnodes N --node-rank k --dist-init-addr HOST:PORT`, SGLang's names): each
node runs the same command and holds world / N consecutive ranks. Node 0 is the service: rank 0
and its local ranks as above, plus a control listener on PORT + 1 (HMAC-authenticated with
`--dist-auth-key`) that the other nodes' ranks dial; torch.distributed meets at HOST:PORT. Node
k > 0 is a launcher (`launch_node`): it spawns its ranks, which connect their control channel
to node 0 and then behave exactly as local workers, and it exits when one of them does. A lost
node closes its ranks' control connections, which rank 0's monitor sees like a dead local rank."""
from __future__ import annotations

import io
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import structlog
import torch
import torch.distributed as dist

from splitspec.engine.attention import AttentionPlan, Group
from splitspec.engine.kv_pool import KVPool

from target_service.parallel import CommStats, Layout, TensorParallelError, load_sharded
from splitspec.engine.state_pool import StatePlan, StatePool, StateRow
from splitspec.serving import free_port

log = structlog.get_logger(__name__)

READY_TIMEOUT_S = 600.0     # a worker loads its shard in this long, or start-up fails
# The secret's old built-in default: public, so it proves nothing and is refused.
PUBLIC_KEY = "splitspec"
MIN_KEY_BYTES = 16
HELLO_MAX_BYTES = 64        # an authenticated peer's hello ({"rank": r}); anything longer is dropped
HANDSHAKE_TIMEOUT_S = 10.0  # a peer proves the secret and says its hello within this, or is hung up on
MAX_HANDSHAKES = 64         # connections proving the secret at once; more are hung up on at once
ACCEPT_POLL_S = 0.5         # how often the accept loop looks whether start-up gave up


def auth_key(key: str | None, key_file: str | None, nnodes: int) -> bytes:
    """The control channel's secret, from --dist-auth-key (or SPLITSPEC_DIST_AUTH_KEY) or
    --dist-auth-key-file; ValueError naming the flags when several nodes would run without a
    real one. Anyone holding it can drive every rank (they run what node 0 sends them), so the
    public default and an empty or short secret are refused rather than warned about. One node
    has no control port: no secret needed."""
    if key_file:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--dist-auth-key-file {key_file}: {exc.strerror or exc}") from None
    key = key or ""
    if nnodes <= 1:
        return key.encode()
    if key == PUBLIC_KEY:
        raise ValueError(f"--dist-auth-key {PUBLIC_KEY!r} is the old public default: with --nnodes > 1 set a "
                         "secret of your own (flag, SPLITSPEC_DIST_AUTH_KEY or --dist-auth-key-file), the same "
                         "on every node")
    if len(key.encode()) < MIN_KEY_BYTES:
        raise ValueError(f"--nnodes > 1 needs a secret of {MIN_KEY_BYTES} bytes at least for the ranks' control "
                         f"channel (--dist-auth-key, SPLITSPEC_DIST_AUTH_KEY or --dist-auth-key-file; got "
                         f"{'none' if not key else f'{len(key.encode())} bytes'}), e.g. `openssl rand -hex 32`")
    return key.encode()


def _send_json(conn, obj) -> None:
    conn.send_bytes(json.dumps(obj).encode())


def _recv_json(conn, maxlength: int | None = None):
    """What a rank reports to node 0 travels as JSON, never pickle: node 0 runs nothing a peer sends."""
    return json.loads(conn.recv_bytes(maxlength))


class _ControlUnpickler(pickle.Unpickler):
    """A worker reads node 0's step descriptions (dicts, lists, numbers and numpy arrays) with
    this: a message naming any other class or function is refused, so even a peer that got past
    the authentication cannot make a worker run code by pickling it."""
    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("numpy.core.numeric", "_frombuffer"),
               ("numpy._core.numeric", "_frombuffer")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"the control channel carries no {module}.{name}")
        return super().find_class(module, name)


def _loads(data: bytes):
    return _ControlUnpickler(io.BytesIO(data)).load()


class RecordingKVPool(KVPool):
    """Rank 0's pool: KV copies between slots (an accepted tree path compacted after verify)
    are kept until the next forward carries them to the workers, which apply them first."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.moves: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy_slots(self, frm: torch.Tensor, to: torch.Tensor) -> None:
        super().copy_slots(frm, to)
        self.moves.append((frm.cpu(), to.cpu()))


class RecordingStatePool(StatePool):
    """Rank 0's KDA state slots: a slot zeroed for a new session and a committed row (which
    tokens of the last forward stay) are kept for the workers, who apply them, commits first,
    before the next forward, in the order rank 0 did them."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.events: list[tuple] = []

    def allocate(self) -> int:
        slot = super().allocate()
        self.events.append(("zero", slot))
        return slot

    def on_commit(self, row: int, path: list[int]) -> None:
        self.events.append(("commit", row, list(path)))

    def copy(self, src: int, dst: int) -> None:
        super().copy(src, dst)
        self.events.append(("copy", src, dst))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _plan_to_wire(plan: AttentionPlan) -> dict:
    return {"slots": _np(plan.slot_mapping),
            "groups": [((_np(g.q_index), _np(g.kv_index), _np(g.mask), _np(g.valid), _np(g.flat)),
                        (g.in_order, g.kv_start, g.kv_stride, g.no_mask, g.causal)) for g in plan.groups]}


def _plan_from_wire(d: dict, device) -> AttentionPlan:
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return AttentionPlan(t(d["slots"]), [Group(*(t(a) for a in g), *flags) for g, flags in d["groups"]])


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r runs on the r-th device after the one asked for (cuda:0 -> cuda:0, cuda:1, ...)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def init_group(rank: int, world: int, port: int, device: torch.device, timeout_s: float,
               host: str = "127.0.0.1") -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", world_size=world, rank=rank,
                            timeout=timedelta(seconds=timeout_s))


def dial(host: str, port: int, key: bytes, rank: int, timeout_s: float):
    """A remote rank's control channel to node 0 (retried until node 0 listens, at most
    timeout_s); raises ConnectionError naming the address when it never answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = multiprocessing.connection.Client((host, port), authkey=key)     # both ends prove the key
            _send_json(conn, {"rank": rank})
            return conn
        except (ConnectionRefusedError, OSError) as exc:
            if time.monotonic() > deadline:
                raise ConnectionError(f"rank {rank}: node 0's control port {host}:{port} did not answer within "
                                      f"{timeout_s:.0f} s ({exc}); check --dist-init-addr and that node 0 is "
                                      f"starting") from None
            time.sleep(0.5)


# ---- ranks 1..N-1 ------------------------------------------------------------------------------

def worker_main(rank: int, world: int, port: int, spec: dict, conn) -> None:
    """Entry point of a spawned rank: join the group, load the shard, then run what rank 0 sends."""
    if spec.get("torch_threads"):
        torch.set_num_threads(spec["torch_threads"])
    local = spec.get("local_rank", rank)
    device = rank_device(torch.device(spec["device"]), local)
    try:
        if conn is None:            # a rank on another node: its control channel dials node 0
            conn = dial(spec["host"], port + 1, spec["key"], rank, spec["timeout_s"])
        init_group(rank, world, port, device, spec["timeout_s"], spec.get("host", "127.0.0.1"))
        model, _ = load_sharded(spec["model_path"], world, rank, dtype=spec["dtype"], device=device)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails start-up with it
        if conn is None:            # no channel to report on: this node's launcher sees the exit code
            log.error("tensor_parallel_rank_failed", rank=rank, error=f"{type(exc).__name__}: {exc}")
            raise SystemExit(1) from None
        _send_json(conn, ["error", f"rank {rank}: {type(exc).__name__}: {exc}"])
        return
    _send_json(conn, ["ready", None])
    pool = None
    last_states = None      # the KDA rows of the last forward: rank 0's commits for them come with the next
    try:
        while True:
            try:
                msg = _loads(conn.recv_bytes())
            except (EOFError, OSError):
                return                          # rank 0 is gone: nothing left to serve
            kind = msg["kind"]
            if kind == "stop":
                return
            if kind == "pool":
                p = msg["pool"]
                pool = KVPool(device=device, dtype=spec["dtype"], **p)
                if msg.get("states"):
                    pool.states = StatePool(device=device, **msg["states"])
                last_states = None
            elif kind == "forward":
                for frm, to in msg["moves"]:
                    pool.copy_slots(torch.from_numpy(frm).to(device), torch.from_numpy(to).to(device))
                with torch.inference_mode():
                    for event in msg.get("state_events", ()):
                        if event[0] == "commit":
                            last_states.commit(event[1], event[2])
                        elif event[0] == "copy":
                            pool.states.copy(event[1], event[2])
                        else:
                            pool.states.conv[:, event[1]].zero_()
                            pool.states.rec[:, event[1]].zero_()
                from splitspec.models.dense import PagedBatch
                plan = _plan_from_wire(msg["plan"], device)
                states = None
                if msg.get("states") is not None:
                    rows, rollback = msg["states"]
                    states = last_states = StatePlan(pool.states, [StateRow(*r) for r in rows], rollback)
                with torch.inference_mode():
                    model.forward_batch(torch.from_numpy(msg["ids"]).to(device),
                                        torch.from_numpy(msg["positions"]).to(device),
                                        PagedBatch(pool, plan, states),
                                        logits_index=torch.from_numpy(msg["index"]).to(device))
            elif kind == "comm_stats":
                CommStats.reset(msg["enabled"])
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group may already be broken
            pass


# ---- rank 0 ------------------------------------------------------------------------------------

class TensorParallelDriver:
    """Rank 0's sharded model behind the interface the runner and scheduler use (`cfg`,
    `parameters()`, `forward_batch`); each forward first sends its step to the workers."""

    def __init__(self, model, layout: Layout, procs: list, conns: list, backend: str, remote: int = 0,
                 listener=None):
        self.inner, self.layout, self.procs, self.conns = model, layout, procs, conns
        self.remote = remote        # the last `remote` conns reach ranks on other nodes
        self.listener = listener
        self.cfg = model.cfg
        self.backend = backend
        self.pool: RecordingKVPool | None = None
        self.failure: str | None = None
        self.on_failure = None              # set by the server: turn health NOT_SERVING
        self.closing = False
        self.send_s = 0.0                   # time spent pickling and writing step descriptions
        self.sends = 0
        self.send_bytes = 0
        self._lock = threading.Lock()
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()

    # what pools.make_pool reads
    @property
    def local_kv_heads(self) -> int:
        return self.layout.kv_heads

    pool_class = RecordingKVPool
    state_pool_class = RecordingStatePool

    @property
    def local_kda_heads(self) -> int:
        return self.layout.kda_heads

    @property
    def world(self) -> int:
        return self.layout.world

    def describe(self) -> str:
        return f"{self.layout.describe(self.cfg)}; {self.backend}"

    def parameters(self):
        return self.inner.parameters()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def attach_pool(self, pool: KVPool) -> None:
        """The workers build the same pool (same blocks, their share of the KV heads)."""
        self.pool = pool
        states = None
        if pool.states is not None:
            st = pool.states
            states = dict(num_layers=st.rec.shape[0], num_slots=st.num_slots, conv_channels=st.conv.shape[2],
                          conv_kernel=st.conv.shape[3] + 1, heads=st.rec.shape[2], k_dim=st.rec.shape[3],
                          v_dim=st.rec.shape[4])
            st.events = []
        self._send({"kind": "pool", "pool": dict(num_layers=pool.k.shape[0], num_kv_heads=pool.k.shape[2],
                                                   head_dim=pool.k.shape[3], v_head_dim=pool.v.shape[3],
                                                   num_blocks=pool.num_blocks, block_size=pool.block_size),
                    "states": states})

    def forward_batch(self, input_ids, positions, batch, *, hidden_layers=(), logits_index=None, max_position=None):
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        moves = []
        if isinstance(batch.pool, RecordingKVPool):
            moves, batch.pool.moves = [(_np(f), _np(t)) for f, t in batch.pool.moves], []
        if logits_index is None:
            logits_index = torch.arange(input_ids.shape[0], device=input_ids.device)
        events, states = [], None
        if batch.states is not None:
            st = batch.states
            events, st.pool.events = st.pool.events, []
            states = ([(r.slot, r.start, r.q_len, r.parents, r.verify) for r in st.rows], st.rollback)
        self._send({"kind": "forward", "moves": moves, "ids": _np(input_ids), "positions": _np(positions),
                    "plan": _plan_to_wire(batch.plan), "index": _np(logits_index), "states": states,
                    "state_events": events})
        try:
            return self.inner.forward_batch(input_ids, positions, batch, hidden_layers=hidden_layers,
                                            logits_index=logits_index, max_position=max_position)
        except RuntimeError as exc:     # a collective failed: a peer died or timed out
            self._fail(f"a collective failed: {exc}")
            raise TensorParallelError(self.failure) from exc

    def comm_stats(self, enabled: bool) -> None:
        """Time collectives on every rank (benchmarks); rank 0's totals are in CommStats."""
        CommStats.reset(enabled)
        self._send({"kind": "comm_stats", "enabled": enabled})

    def _send(self, msg: dict) -> None:
        t = time.perf_counter()
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for c in self.conns:
                c.send_bytes(data)
        except (BrokenPipeError, OSError) as exc:
            self._fail(f"a tensor-parallel rank is gone ({exc})")
            raise TensorParallelError(self.failure) from exc
        self.send_s += time.perf_counter() - t
        self.sends += 1
        self.send_bytes += len(data)

    def _watch(self) -> None:
        sentinels = {p.sentinel: i + 1 for i, p in enumerate(self.procs)}
        # A remote rank never writes after "ready": its connection turns readable only at EOF.
        far = {c: len(self.conns) - self.remote + i + 1 for i, c in enumerate(self.conns[len(self.conns) - self.remote:])}
        ready = multiprocessing.connection.wait(list(sentinels) + list(far))
        if self.closing:
            return
        if ready[0] in far:
            self._fail(f"tensor-parallel rank {far[ready[0]]} on another node is gone (its control connection "
                       f"closed); this replica is out of service")
            return
        rank = sentinels[ready[0]]
        code = self.procs[rank - 1].exitcode
        self._fail(f"tensor-parallel rank {rank} exited (code {code}); this replica is out of service")

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = why
        log.error("tensor_parallel_failed", reason=why)
        if self.on_failure is not None:
            self.on_failure(why)

    def close(self) -> None:
        self.closing = True
        for c in self.conns:
            try:
                c.send_bytes(pickle.dumps({"kind": "stop"}))
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
        if self.listener is not None:
            self.listener.close()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group cannot be torn down cleanly
            pass


def start(model_path: str, world: int, *, dtype: torch.dtype, device: torch.device, timeout_s: float,
          torch_threads: int = 0, nnodes: int = 1, dist_init_addr: str | None = None,
          auth_key: bytes = b"") -> TensorParallelDriver:
    """Node 0: spawn its local ranks 1..world/nnodes-1, accept the other nodes' ranks on the
    control port, join the group as rank 0, load every shard; returns rank 0's driver once every
    rank has its weights (or raises with the failing rank's error)."""
    from splitspec.models.config import ModelConfig
    from target_service.parallel import make_layout
    make_layout(ModelConfig.from_dir(model_path), world)    # a shape that does not divide fails before any spawn
    local = world // nnodes
    host, port = ("127.0.0.1", free_port()) if nnodes == 1 else split_addr(dist_init_addr)
    ctx = mp.get_context("spawn")
    spec = dict(model_path=str(model_path), device=str(device), dtype=dtype, timeout_s=timeout_s,
                torch_threads=torch_threads, host=host)
    listener, accepted, closed = None, {}, threading.Event()
    if nnodes > 1:
        listener = control_listener(host, port + 1)
        threading.Thread(target=_accept, args=(listener, auth_key, range(local, world), accepted, closed),
                         daemon=True, name="tp-accept").start()
    procs, conns = [], []
    for rank in range(1, local):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker_main, args=(rank, world, port, spec, child), daemon=True,
                        name=f"splitspec-tp-rank{rank}")
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    try:
        try:
            init_group(0, world, port, rank_device(device, 0), timeout_s, host)
        except (RuntimeError, OSError) as exc:      # DistStoreError / DistNetworkError: ranks missing
            hint = (f"; start the other nodes (--node-rank 1..{nnodes - 1}) with --dist-init-addr {host}:{port}"
                    if nnodes > 1 else "")
            raise TensorParallelError(f"the tensor-parallel group of {world} ranks did not form at {host}:{port} "
                                      f"within --tp-timeout-s {timeout_s:g} ({exc}){hint}") from None
        model, layout = load_sharded(model_path, world, 0, dtype=dtype, device=rank_device(device, 0))
        deadline = time.monotonic() + READY_TIMEOUT_S
        if nnodes > 1:
            # every rank joined the group above, so each has dialled in already (or is about to)
            while len(accepted) < world - local and time.monotonic() < deadline:
                time.sleep(0.05)
            missing = sorted(set(range(local, world)) - set(accepted))
            if missing:
                raise TensorParallelError(f"tensor-parallel ranks {missing} never reached the control port "
                                          f"{host}:{port + 1}")
        remote = [accepted[r] for r in range(local, world)]
        for rank, c in enumerate(conns + remote, start=1):
            p = procs[rank - 1] if rank < local else None
            while not c.poll(0.2):
                if p is not None and not p.is_alive():
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited during start-up "
                                              f"(code {p.exitcode})")
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"tensor-parallel rank {rank} did not load within {READY_TIMEOUT_S} s")
            try:
                kind, detail = _recv_json(c)
            except (EOFError, ValueError):
                raise TensorParallelError(f"tensor-parallel rank {rank} closed its control connection during "
                                          f"start-up") from None
            if kind != "ready":
                raise TensorParallelError(f"tensor-parallel start-up failed: {detail}")
    except BaseException:
        for p in procs:
            p.terminate()
        if listener is not None:
            closed.set()
            listener.close()
        raise
    backend = "nccl" if device.type == "cuda" else "gloo"
    log.info("tensor_parallel_ready", world=world, nnodes=nnodes, backend=backend,
             pids=[os.getpid()] + [p.pid for p in procs], layout=layout.describe(model.cfg))
    return TensorParallelDriver(model, layout, procs, conns + remote, backend, remote=len(remote), listener=listener)


def split_addr(addr: str | None) -> tuple[str, int]:
    """HOST:PORT of --dist-init-addr (ValueError naming the flag when malformed)."""
    host, _, port = (addr or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"--dist-init-addr {addr!r}: expected HOST:PORT (node 0's address; PORT + 1 must be free "
                         f"too, for the ranks' control channels)")
    return host.strip("[]"), int(port)


def control_listener(host: str, port: int) -> socket.socket:
    """Node 0's control port: a listening socket whose accept returns every ACCEPT_POLL_S, so
    the accept loop sees when start-up gave up."""
    listener = socket.create_server((host, port))
    listener.settimeout(ACCEPT_POLL_S)
    return listener


def _accept(listener: socket.socket, key: bytes, ranks: range, into: dict, closed: threading.Event,
            timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Node 0: accept the control connections of the ranks on other nodes (`ranks`), keyed by
    rank. Each connection proves the secret and says its hello on a thread of its own within
    timeout_s (`_handshake`), so a peer that connects and says nothing holds up neither
    start-up nor the ranks that dial after it."""
    lock, slots = threading.Lock(), threading.BoundedSemaphore(MAX_HANDSHAKES)
    while len(into) < len(ranks) and not closed.is_set():
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError as exc:
            if closed.is_set() or listener.fileno() < 0:        # start-up gave up, or the driver closed
                return
            log.warning("tensor_parallel_control_refused", reason=f"{type(exc).__name__}: {exc}")
            continue
        if not slots.acquire(blocking=False):
            log.warning("tensor_parallel_control_refused", reason=f"{MAX_HANDSHAKES} handshakes already under way")
            sock.close()
            continue
        sock.settimeout(None)
        threading.Thread(target=_handshake, args=(sock, key, ranks, into, lock, slots, timeout_s), daemon=True,
                         name="tp-handshake").start()


def _handshake(sock: socket.socket, key: bytes, ranks: range, into: dict, lock: threading.Lock,
               slots: threading.BoundedSemaphore, timeout_s: float) -> None:
    """One control connection: the HMAC challenge both ways, then the hello, within timeout_s
    (at the deadline the socket is shut down, which ends a read waiting on a silent peer). The
    challenge reads nothing but the peer's digest (bounded), so a peer without the secret is
    dropped before any of its data is read; an authenticated peer's hello is a few bytes of
    JSON, its rank checked."""
    conn = multiprocessing.connection.Connection(os.dup(sock.fileno()))
    settled = threading.Lock()      # taken by whichever comes first: the hello or the deadline

    def cut():
        if settled.acquire(blocking=False):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    timer = threading.Timer(timeout_s, cut)
    timer.daemon = True
    timer.start()
    try:
        multiprocessing.connection.deliver_challenge(conn, key)
        multiprocessing.connection.answer_challenge(conn, key)
        rank = _recv_json(conn, HELLO_MAX_BYTES).get("rank")
        if not settled.acquire(blocking=False):
            raise TimeoutError(f"no hello within {timeout_s:g} s")
    except (OSError, EOFError, ValueError, AttributeError, multiprocessing.AuthenticationError) as exc:
        log.warning("tensor_parallel_control_refused", reason=f"{type(exc).__name__}: {exc}")
        conn.close()
        return
    finally:
        timer.cancel()
        sock.close()            # conn keeps its own descriptor of the connection
        slots.release()
    with lock:
        if type(rank) is not int or rank not in ranks or rank in into:
            log.warning("tensor_parallel_control_refused", reason=f"rank {rank!r} is not one of the other nodes' "
                        f"ranks {ranks.start}..{ranks.stop - 1} still missing")
            conn.close()
            return
        into[rank] = conn


def launch_node(model_path: str, world: int, *, nnodes: int, node_rank: int, dist_init_addr: str,
                dtype: torch.dtype, device: torch.device, timeout_s: float, torch_threads: int = 0,
                auth_key: bytes = b"") -> int:
    """Node k > 0: spawn this node's ranks (k·L .. k·L + L - 1, L = world / nnodes), which dial
    node 0 and serve its forwards; return when one of them exits (its exit code, or 1 when one
    failed), terminating the others, so the node's supervisor restarts the group."""
    host, port = split_addr(dist_init_addr)
    local = world // nnodes
    ctx = mp.get_context("spawn")
    procs = []
    for i in range(local):
        rank = node_rank * local + i
        spec = dict(model_path=str(model_path), device=str(device), dtype=dtype, timeout_s=timeout_s,
                    torch_threads=torch_threads, host=host, key=auth_key, local_rank=i)
        p = ctx.Process(target=worker_main, args=(rank, world, port, spec, None), daemon=True,
                        name=f"splitspec-tp-rank{rank}")
        p.start()
        procs.append(p)
    log.info("tensor_parallel_node", node_rank=node_rank, nnodes=nnodes, ranks=[node_rank * local + i for i in range(local)],
             dist_init_addr=dist_init_addr, pids=[p.pid for p in procs])
    try:
        multiprocessing.connection.wait([p.sentinel for p in procs])
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
    codes = [p.exitcode for p in procs]
    log.info("tensor_parallel_node_exited", node_rank=node_rank, exit_codes=codes)
    return 0 if all(c == 0 for c in codes) else 1

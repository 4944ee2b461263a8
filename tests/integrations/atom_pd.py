"""Two ATOM engines exchanging KV through the atom_kv connector, driven the way ATOM drives connectors.

Whatever ``atom`` is importable (ATOM itself, or ``fake_atom`` for the
contract test) provides ``Scheduler``, ``Sequence``, ``BlockManager``, the
connector factory, ``KVCacheTensor`` and the TP aggregator. This module plays
the parts ATOM cannot run without a GPU, mirroring ATOM main (ffdf3bb5d):

- ``AtomEngine.step`` is one pass of ``EngineCore.busy_loop``: when the
  scheduler has work, ``schedule()`` -> ``take_rejected()`` -> the batch's
  ``connector_meta_output`` to every rank's ``start_load_kv`` -> the forward
  -> every rank's ``get_finished()`` through ``KVOutputAggregator`` into
  ``Scheduler._update_from_kv_xfer_finished`` -> ``postprocess`` with a
  stream queue; when idle but KV work is pending
  (``deferred_free_blocks`` or ``has_pending_work()``), the poll alone.
- ``Rank`` is one model runner: an ``AtomKVWorker`` over CPU tensors laid out
  as ATOM allocates them (AITER K ``[P, h, d/x, p, x]``, shuffled V ``[P, h,
  p/x, d, x]``, or ATOM's MLA ``[P*p, 1, L]``), registered as ATOM's
  ``{"layer_<n>": KVCacheTensor}``.
- A prefill engine with ``pp`` pipeline stages runs like ATOM's
  ``PPEngineCoreProc``: every stage's ranks get a copy of the ``Config`` with
  its ``pipeline_parallel_rank`` and hold their stage's layers (keyed by the
  global layer, ``layer_num`` counting from 0 on each stage, as ATOM's model
  runner binds them); the head stage's scheduler sends every batch's
  metadata to every stage, and only the head stage's ranks' output reaches
  the scheduler (ATOM's head routes the later stages' reports through its
  offload aggregator, which drops ``finished_sending``).
- With ``kv_events_config`` (ATOM's ``KVEventsConfig``), ATOM's scheduler
  publishes its block manager's KV cache events after every engine step, as
  ``EngineCore`` does, and shuts its publisher down on ``close()``.
- The "model" writes KV that is a pure function of (engine seed, token,
  position, layer, kind, head) for every token it computes, and samples a
  token that depends only on the prompt and the step. Before a request's
  first decode the forward checks every prompt token's KV on every rank: the
  producer's values where it was read, this engine's own where it was cached
  or computed here. A load that moved a wrong byte, missed one, or wrote into
  a locally cached block fails the test; outputs must match a colocated run
  whether the prompt's KV was read or recomputed.
"""

from __future__ import annotations

import copy
import queue
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Optional

import torch

from atom.config import KVCacheTensor
from atom.kv_transfer.disaggregation import KVOutputAggregator
from atom.model_engine.scheduler import ScheduledBatchOutput, Scheduler
from atom.model_engine.sequence import Sequence, SequenceStatus, SequenceType
from atom.sampling_params import SamplingParams

from atom_kv.integrations.atom import register
from atom_kv.integrations.atom.worker import AtomKVWorker
from tests.connector.kvutil import OS_ASSIGNED

LAYERS = 2
HEADS = 4          # KV heads of the model, split over TP ranks
HEAD_DIM = 16
LATENT = 64        # MLA latent width
FP8 = torch.float8_e4m3fn
EOS = 2
_KIND = {"k": 0, "v": 5, "latent": 11, "k_scale": 13, "v_scale": 17}

register()  # what atom_kv_atom.pth does at start-up (test_atom_hook.py proves the .pth itself)


def atom_config(role: str, *, tp: int, block_size: int, num_blocks: int, port: int, backend: str,
                max_num_seqs: int = 8, prefix_caching: bool = False, dp_rank: int = 0, dp_size: int = 1,
                pp_size: int = 1, layers: int = LAYERS, kv_events_config: Any = None, **kv: Any) -> SimpleNamespace:
    """What ATOM's Scheduler and our connector read from ATOM's ``Config`` (ATOM's tests' MockConfig fields);
    ``kv_events_config``: ATOM's ``KVEventsConfig`` (its KV cache events), None for ATOM's default (off)."""
    kv_cfg = dict(kv_connector="atom_kv", kv_role=role, handshake_port=port, backend=backend,
                  handshake_timeout_s=2.0, transfer_timeout_s=2.0, abort_timeout_s=30.0, transfer_retries=0,
                  **OS_ASSIGNED)  # only the handshake ports were found free
    kv_cfg.update(kv)
    return SimpleNamespace(
        kv_cache_block_size=block_size, num_kvcache_blocks=num_blocks, enable_prefix_caching=prefix_caching,
        enable_chunked_prefill=True, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
        long_prefill_token_threshold=0, decode_context_parallel_size=1, max_model_len=2048, bos_token_id=1,
        eos_token_id=EOS, stop_token_ids=[], scheduler_delay_factor=0.0, speculative_config=None,
        hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"], sliding_window=128, num_hidden_layers=layers),
        kv_transfer_config=kv_cfg, tensor_parallel_size=tp, pipeline_parallel_size=pp_size,
        parallel_config=SimpleNamespace(data_parallel_rank=dp_rank, data_parallel_size=dp_size,
                                        pipeline_parallel_rank=0),
        model="/models/tiny-llama", kv_events_config=kv_events_config,
    )


def sample(prompt: list[int], step: int) -> int:
    """The token the "model" samples at completion step ``step`` (0: the prefill's)."""
    return 3 + (sum(prompt) * 7 + step * 13) % 997


def kv_values(seed: int, token: int, pos: int, layer: int, kind: str, head: int, width: int,
              dtype: torch.dtype) -> torch.Tensor:
    """The KV the "model" of engine ``seed`` computes for one token: exact in ``dtype``, different per
    (engine, token, position, layer, kind, head); a float32 scalar for an fp8 scale."""
    base = seed * 7919 + token * 131 + pos * 17 + layer * 7 + head * 3 + _KIND[kind]
    if kind.endswith("_scale"):
        return torch.tensor((base % 113) / 8.0, dtype=torch.float32)
    values = (base + torch.arange(width)) % 127  # as fp8 bytes: never a NaN pattern
    return values.to(torch.uint8).view(FP8) if dtype == FP8 else values.to(dtype)


class Rank:
    """One TP rank's model runner: its KV tensors as ATOM allocates them and its worker connector."""

    def __init__(self, config: Any, tp_rank: int, tp: int, *, mla: bool, dtype: torch.dtype,
                 shuffled_v: bool = True, dp_rank: int = 0, layers: Optional[range] = None) -> None:
        self.tp_rank, self.tp, self.mla, self.dtype, self.shuffled_v = tp_rank, tp, mla, dtype, shuffled_v
        self.global_layers = layers if layers is not None else range(LAYERS)  # the model layers this rank holds
        self.block_size = config.kv_cache_block_size
        nb = config.num_kvcache_blocks
        self.heads = 1 if mla else HEADS // tp
        # ATOM main: non-MLA physical blocks of 16 tokens (block_ratio = block_size / 16), MLA rows of 1 token
        self.p = 1 if mla else 16
        self.ratio = self.block_size // self.p
        self.x = 16 // torch.empty((), dtype=dtype).element_size()  # AITER packs 16 bytes
        P, x = nb * self.ratio, self.x
        self.layers: list[dict[str, torch.Tensor]] = []
        caches = {}
        for layer, global_layer in enumerate(self.global_layers):  # ATOM: keyed by the global layer
            if mla:
                t = {"latent": _empty((P * self.p, 1, LATENT), dtype)}
                caches[f"layer_{global_layer}"] = KVCacheTensor(layer_num=layer, k_cache=t["latent"], v_cache=None)
            else:
                v_shape = (P, self.heads, self.p // x, HEAD_DIM, x) if shuffled_v else (P, self.heads, HEAD_DIM, self.p)
                t = {"k": _empty((P, self.heads, HEAD_DIM // x, self.p, x), dtype), "v": _empty(v_shape, dtype)}
                if dtype == FP8:  # ATOM's per-token fp8 scales, [P, h, p] float32
                    t["k_scale"] = _empty((P, self.heads, self.p), torch.float32)
                    t["v_scale"] = _empty((P, self.heads, self.p), torch.float32)
                caches[f"layer_{global_layer}"] = KVCacheTensor(layer_num=layer, k_cache=t["k"], v_cache=t["v"],
                                                                k_scale=t.get("k_scale"), v_scale=t.get("v_scale"))
            self.layers.append(t)
        self.worker = AtomKVWorker(config, tp_rank=tp_rank, tp_size=tp, dp_rank=dp_rank, host="127.0.0.1")
        self.worker.register_kv_caches(caches, None, num_blocks=nb)

    def _slot(self, t: torch.Tensor, kind: str, block: int, slot: int, h: int) -> torch.Tensor:
        """A view of one token's ``HEAD_DIM`` (or latent) values of one head, wherever this layout keeps them
        (K: ``[d/x, x]``, value ``i*x + j`` at ``[i, j]``)."""
        if self.mla:
            return t[block * self.block_size + slot, 0]
        pb, ps = block * self.ratio + slot // self.p, slot % self.p
        if kind.endswith("_scale"):
            return t[pb, h, ps]
        if kind == "k":
            return t[pb, h, :, ps, :]
        if not self.shuffled_v:  # ATOM 0c982ea92's V: [P, h, d, p]
            return t[pb, h, :, ps]
        return t[pb, h, ps // self.x, :, ps % self.x]

    def _cells(self, seq: Sequence, positions: Iterable[int], seed: Callable[[int], int]):
        for pos in positions:
            block, slot = seq.block_table[pos // self.block_size], pos % self.block_size
            for layer, tensors in zip(self.global_layers, self.layers):
                for kind, t in tensors.items():
                    for h in range(self.heads):
                        head = 0 if self.mla else self.tp_rank * self.heads + h
                        width = LATENT if self.mla else HEAD_DIM
                        want = kv_values(seed(pos), seq.token_ids[pos], pos, layer, kind, head, width, self.dtype)
                        yield self._slot(t, kind, block, slot, h), want, (pos, layer, kind, head)

    def compute(self, seq: Sequence, positions: Iterable[int], seed: int) -> None:
        for dst, value, _ in self._cells(seq, positions, lambda _: seed):
            dst.copy_(value.view(dst.shape))

    def check(self, seq: Sequence, positions: Iterable[int], seed: Callable[[int], int]) -> Optional[str]:
        """Where the KV of ``positions`` differs from what engine ``seed(position)`` computed."""
        for got, want, where in self._cells(seq, positions, seed):
            if not torch.equal(got.to(torch.float32), want.view(got.shape).to(torch.float32)):
                return f"rank {self.tp_rank}: KV of (position, layer, kind, head) {where} is wrong"
        return None


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A cache tensor that holds no KV yet (bytes that no "model" value has)."""
    if dtype == FP8:
        return torch.full(shape, 127, dtype=torch.uint8).view(FP8)
    return torch.full(shape, -1.0, dtype=dtype)


class AtomEngine:
    """ATOM's scheduler plus TP model runners in this process, stepped like ATOM's EngineCore
    (one DP rank of an engine: ``dp_rank`` of ``dp_size``, as ATOM's DP-attention engine cores;
    with ``pp`` stages, like its ``PPEngineCoreProc``: the head stage's scheduler, every stage's ranks)."""

    def __init__(self, name: str, role: str, *, tp: int, port: int, seed: int, backend: str = "tcp",
                 block_size: int = 16, num_blocks: int = 64, mla: bool = False, fp8: bool = False,
                 shuffled_v: bool = True, prefix_caching: bool = False, dp_rank: int = 0, dp_size: int = 1,
                 upstream: bool = False, pp: int = 1, layers: int = LAYERS, kv_events_config: Any = None,
                 **kv: Any) -> None:
        self.name = name
        self.seed = seed
        self.remote_seed: Optional[int] = None  # the producer's, for KV read from it
        self.remote_seed_of: dict[int, int] = {}  # per request, where producers differ (DP ranks)
        self.config = atom_config(role, tp=tp, block_size=block_size, num_blocks=num_blocks, port=port,
                                  backend=backend, prefix_caching=prefix_caching, dp_rank=dp_rank, dp_size=dp_size,
                                  pp_size=pp, layers=layers, kv_events_config=kv_events_config, **kv)
        self.config.upstream_connector_contract = upstream  # the fake ATOM with docs/atom-upstream.md
        self.num_blocks = num_blocks
        self.stages: list[list[Rank]] = []  # each pipeline stage's TP ranks; the head stage first
        per_stage = layers // pp
        for stage in range(pp):
            stage_config = copy.deepcopy(self.config)  # what ATOM's CoreManager gives each stage's engine core
            stage_config.parallel_config.pipeline_parallel_rank = stage
            held = range(stage * per_stage, layers if stage == pp - 1 else (stage + 1) * per_stage)
            self.stages.append([Rank(stage_config, r, tp, mla=mla, dtype=FP8 if fp8 else torch.bfloat16,
                                     shuffled_v=shuffled_v, dp_rank=dp_rank, layers=held) for r in range(tp)])
        self.ranks = [rank for stage in self.stages for rank in stage]
        self.sched = Scheduler(self.config)  # ATOM builds the connector here, through its factory
        self.connector = self.sched.kv_connector
        assert type(self.connector).__name__ == "AtomKVScheduler", type(self.connector)
        self.cached_at_alloc: dict[int, int] = {}  # prompt tokens in the local prefix cache at allocation
        allocated = self.connector.update_state_after_alloc

        def note_prefix_hit(seq: Sequence) -> None:
            self.cached_at_alloc[seq.id] = int(seq.num_cached_tokens)
            allocated(seq)

        self.connector.update_state_after_alloc = note_prefix_hit
        self.aggregator = KVOutputAggregator(world_size=tp)
        self.stream: queue.Queue = queue.Queue()
        self.finished: dict[int, Sequence] = {}
        self.errors: list[str] = []
        self.prefilled: set[int] = set()  # requests whose prompt KV this engine computed itself
        self._checked: set[int] = set()

    # -- requests --------------------------------------------------------
    def add(self, prompt: list[int], max_tokens: int, params: Optional[dict] = None) -> Sequence:
        seq = Sequence(list(prompt), self.config.kv_cache_block_size, sampling_params=SamplingParams(
            max_tokens=max_tokens), kv_transfer_params=params)
        self.sched.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """What ATOM's abort_request utility does: mark it; the scheduler finishes it at its next step."""
        seq.status = SequenceStatus.ABORTED

    # -- the engine core loop ---------------------------------------------
    def step(self) -> None:
        if not self.sched.is_finished():
            try:
                self._engine_step()
            finally:  # EngineCore._process_engine_step: the step's KV events go out after it, whatever happened
                self.sched.publish_kv_events()
        elif self.has_pending_kv_work():
            self._poll()

    def has_pending_kv_work(self) -> bool:
        if getattr(self.sched, "deferred_free_blocks", None):
            return True
        return bool(self.connector.has_pending_work())

    def _engine_step(self) -> None:
        result = self.sched.schedule()
        for seq in self.sched.take_rejected():
            self.finished[seq.id] = seq
        if result is None:
            self._poll()
            return
        batch, seqs = result
        if batch is None:
            self._poll()
            return
        if batch.connector_meta_output is not None:  # the head sends every batch to every stage
            for rank in self.ranks:
                rank.worker.start_load_kv(batch.connector_meta_output)
        fwd = self._forward(batch, seqs) if seqs else None
        self._poll()
        if not seqs:
            return
        for seq in self.sched.postprocess(list(seqs.values()), fwd, stream_output_queue=self.stream, batch=batch):
            self.finished[seq.id] = seq

    def _poll(self) -> None:
        for stage in self.stages[1:]:  # ATOM's later stages report to the head; P/D fields go no further
            for rank in stage:
                rank.worker.get_finished()
        head = self.stages[0]
        self.sched._update_from_kv_xfer_finished(self.aggregator.aggregate([r.worker.get_finished() for r in head]))

    def _forward(self, batch: Any, seqs: dict[int, Sequence]) -> Any:
        tokens = []
        for i, sid in enumerate(batch.req_ids):
            seq = seqs[sid]
            prompt = seq.token_ids[:seq.num_prompt_tokens]
            if seq.type == SequenceType.PREFILL:
                start = int(batch.num_cached_tokens[i])
                positions = range(start, start + int(batch.num_scheduled_tokens[i]))
                step = 0
                self.prefilled.add(sid)
            else:
                if sid not in self._checked:  # the first decode: the whole prompt's KV must be here
                    self._checked.add(sid)
                    for rank in self.ranks:
                        error = rank.check(seq, range(seq.num_prompt_tokens), self._computed_by(seq))
                        if error:
                            self.errors.append(f"{self.name} seq {sid}: {error}")
                positions = range(seq.num_tokens - 1, seq.num_tokens)
                step = seq.num_tokens - seq.num_prompt_tokens
            for rank in self.ranks:
                rank.compute(seq, positions, self.seed)
            tokens.append((sample(prompt, step),))
        return ScheduledBatchOutput(req_ids=list(batch.req_ids), token_ids=tokens, num_rejected=None,
                                    num_bonus=None, draft_token_ids=None)

    def _computed_by(self, seq: Sequence) -> Callable[[int], int]:
        """Which engine's seed each prompt position's KV must carry."""
        remote = self.remote_seed_of.get(seq.id, self.remote_seed)
        if seq.id in self.prefilled or remote is None:
            return lambda _: self.seed
        cached = self.cached_at_alloc.get(seq.id, 0)
        return lambda pos: self.seed if pos < cached else remote

    # -- checks --------------------------------------------------------------
    def blocks_in_use(self) -> int:
        return self.sched.block_manager.kv.num_used

    def idle(self) -> bool:
        """No request, no deferred block, no connector work, every block free."""
        return self.sched.is_finished() and not self.connector.has_pending_work() and self.blocks_in_use() == 0

    def close(self) -> None:
        self.sched.shutdown_kv_events()  # EngineCore's teardown: the KV event publisher's thread and socket
        self.connector.close()
        for rank in self.ranks:
            rank.worker.close()


def decode_params(producer_seq: Sequence) -> dict:
    """What a proxy sends the decode leg: every key the prefill returned, as a remote prefill."""
    params = dict(producer_seq.kv_transfer_params_output)
    params.update(do_remote_prefill=True, do_remote_decode=False)
    return params


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    return [sample(prompt, i) for i in range(max_tokens)]


def run_until(engines: list[AtomEngine], done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError("timed out; " + "; ".join(
                f"{e.name}: waiting={[(s.id, s.status.name) for s in e.sched.waiting]} "
                f"running={[s.id for s in e.sched.running]} deferred={list(e.sched.deferred_free_blocks)} "
                f"blocks in use={e.blocks_in_use()} pending={e.connector.has_pending_work()}" for e in engines))
        for e in engines:
            e.step()
        time.sleep(0.001)


def prefill_on(P: AtomEngine, prompts: list[list[int]]) -> list[Sequence]:
    """The proxy's first leg: one token on the producer, with ``do_remote_decode``."""
    seqs = [P.add(p, 1, {"do_remote_decode": True}) for p in prompts]
    run_until([P], lambda: all(s.id in P.finished for s in seqs))
    for s in seqs:
        assert s.kv_transfer_params_output is not None, s.id
        assert s.output_tokens == [sample(s.token_ids[:s.num_prompt_tokens], 0)]
    return seqs

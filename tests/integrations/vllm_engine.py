"""A vLLM engine for tests, minus the model: vLLM's real v1 ``Scheduler`` with
our connector loaded by ``kv_connector_module_path``, one worker-side connector
per TP rank over real CPU KV tensors (allocated by vLLM's own
``allocate_kv_cache`` in the HND layout), and a stand-in model that writes a
known KV pattern for every token it "computes". The model's attention layers
are stand-ins too: registered where vLLM's model registers them, each names
the real vLLM attention backend class a model would have chosen (CPU_ATTN by
default, as on a CPU host), which is what tells the connector its KV layout.

Each step follows vLLM's model-runner mixin: bind the metadata, forward,
``start_load_kv``, ``wait_for_save``, ``get_transfer_results``, load errors,
stats, worker metadata; the ranks' outputs are combined by vLLM's own
``KVOutputAggregator`` and handed to ``Scheduler.update_from_output``.

Import only where vLLM is importable (the test modules skip otherwise).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from atom_kv.integrations.vllm import AtomKVConnector

BLOCK = 16
LAYERS = 3  # odd on purpose: each layer registers (and is read) once, whatever the count
KV_HEADS = 2
HEAD = 16
CONTENT = 2 * HEAD  # a token's row: K and V (how they share it is the backend's business)
EOS = 255
SENTINEL = -7.0

init_none_hash(sha256)


def write_tiny_model(folder: Path) -> Path:
    """A Llama config vLLM can build a ModelConfig from, with no weights and no hub."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": KV_HEADS, "max_position_embeddings": 1024, "torch_dtype": "float32",
        "eos_token_id": EOS, "bos_token_id": 1, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    }))
    return folder


class StandInAttention(AttentionLayerBase):
    """STAND-IN for a model's attention layer: only which vLLM attention backend it runs (no weights, no kernels)."""

    def __init__(self, backend: str) -> None:
        self.backend = AttentionBackendEnum[backend].get_class()

    def get_attn_backend(self) -> type:
        return self.backend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> None:
        return None


def layer_names(count: int = LAYERS) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(count)]


def make_vllm_config(model_dir: Path, role: str, extra: dict[str, Any], *, tp_size: int = 1,
                     failure_policy: str = "fail", max_batched_tokens: int = 512,
                     async_scheduling: bool = True, attention_backend: str = "CPU_ATTN") -> VllmConfig:
    """A real VllmConfig whose kv_transfer_config names our module (async scheduling: vLLM's default), with
    the model's attention layers registered as stand-ins running ``attention_backend``."""
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
                        seed=0)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched_tokens, max_model_len=1024,
                            enable_chunked_prefill=True, is_encoder_decoder=False,
                            async_scheduling=async_scheduling)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    kv = KVTransferConfig(kv_connector="AtomKVConnector", kv_connector_module_path="atom_kv.integrations.vllm",
                          kv_role=role, kv_connector_extra_config=dict(extra),
                          kv_load_failure_policy=failure_policy)
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, kv_transfer_config=kv,
                        device_config=DeviceConfig("cpu"), parallel_config=ParallelConfig(tensor_parallel_size=tp_size))
    # vLLM's CPU platform turns async scheduling off; GPU engines run it (vLLM's default): keep what was asked
    config.scheduler_config.async_scheduling = async_scheduling
    # vLLM's engine core resolves the layout from the connector's preference (HND)
    config.cache_config.kv_cache_layout = KVCacheLayout.LBHNC.name
    # where a loaded model's attention layers live (vLLM's connectors look their backends up there)
    for name in layer_names():
        config.compilation_config.static_forward_context[name] = StandInAttention(attention_backend)
    return config


def make_kv_cache_config(vllm_config: VllmConfig, num_blocks: int) -> KVCacheConfig:
    """One full-attention group, every layer in one backing allocation, layer-outermost (as vLLM plans it)."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS // tp, head_size=HEAD, dtype=torch.float32)
    names = layer_names()
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * num_blocks * LAYERS, layers=names, layer_stride=page * num_blocks,
                           block_stride=page)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def pattern(layer: int, heads: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The KV a (layer, head, position, token) gets: ``[len(positions), len(heads), CONTENT]``, exact in float32."""
    base = (tokens.view(-1, 1) * 7919 + positions.view(-1, 1) * 31 + layer * 1009 + heads.view(1, -1) * 101) % 65536
    return (base.unsqueeze(-1) * CONTENT + torch.arange(CONTENT).view(1, 1, -1)).to(torch.float32)


def make_request(rid: str, prompt: list[int], *, max_tokens: int, kv_transfer_params: Optional[dict]) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=False)
    sampling.update_from_generation_config({}, EOS)
    req = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sampling, pooling_params=None,
                  block_hasher=get_request_block_hasher(BLOCK, sha256))
    req.kv_transfer_params = copy.deepcopy(kv_transfer_params)
    return req


@dataclass
class Rank:
    connector: AtomKVConnector
    caches: dict[str, torch.Tensor]
    heads: torch.Tensor


@dataclass
class StepResult:
    scheduled: dict[str, int]
    outputs: list[EngineCoreOutput]
    invalid_block_ids: set[int] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    stats: Optional[dict] = None


class VllmEngine:
    """One engine: vLLM's scheduler (``AsyncScheduler`` when the config asks for async scheduling, as
    ``vllm serve`` does by default; the scheduler-side connector inside) and ``tp_size`` worker-side connectors."""

    def __init__(self, vllm_config: VllmConfig, num_blocks: int = 64) -> None:
        self.vllm_config = vllm_config
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.num_blocks = num_blocks
        self.kv_cache_config = make_kv_cache_config(vllm_config, num_blocks)
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        scheduler_cls = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(vllm_config=vllm_config, kv_cache_config=self.kv_cache_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(vllm_config),
                                   block_size=BLOCK)
        self.ranks: list[Rank] = []
        try:
            for r in range(self.tp_size):
                rank_config = copy.copy(vllm_config)
                rank_config.parallel_config = copy.copy(vllm_config.parallel_config)
                rank_config.parallel_config.rank = r  # what vLLM sets in each worker process
                connector = KVConnectorFactory.create_connector(rank_config, KVConnectorRole.WORKER,
                                                                self.kv_cache_config)
                assert isinstance(connector, AtomKVConnector)
                caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
                for t in caches.values():
                    t.fill_(-1.0)
                hl = KV_HEADS // self.tp_size
                self.ranks.append(Rank(connector, caches, torch.arange(r * hl, (r + 1) * hl)))
                connector.register_kv_caches(caches)
        except BaseException:
            self.close()
            raise
        self.aggregator = KVOutputAggregator(self.tp_size)
        self.layer_names = list(self.kv_cache_config.kv_cache_groups[0].layer_names)
        self.computed: dict[str, list[tuple[int, int]]] = {}  # request -> (start, count) the model computed
        self.sentinel_blocks: set[int] = set()

    @property
    def connector(self) -> AtomKVConnector:
        """The scheduler-side connector vLLM created."""
        connector = self.scheduler.get_kv_connector()
        assert isinstance(connector, AtomKVConnector)
        return connector

    # --- requests -------------------------------------------------------
    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, rid: str) -> None:
        self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    def blocks_of(self, rid: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    # --- one engine step ------------------------------------------------
    def step(self, *, token: int = 7, before_forward: Optional[Callable[[Any], None]] = None) -> StepResult:
        so = self.scheduler.schedule()
        if before_forward is not None:
            before_forward(so)
        outputs: list[ModelRunnerOutput] = []
        for rank in self.ranks:
            c = rank.connector
            c.bind_connector_metadata(so.kv_connector_metadata)
            if so.has_sync_kv_loads:
                c.start_load_kv(None)
            self._forward(rank, so.num_scheduled_tokens)
            if not so.has_sync_kv_loads:
                c.start_load_kv(None)
            c.wait_for_save()
            results = c.get_transfer_results(so.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=c.get_block_ids_with_load_errors(),
                kv_connector_stats=c.get_kv_connector_stats(),
                kv_connector_worker_meta=c.build_connector_worker_meta(),
            )
            c.clear_connector_metadata()
            rids = list(so.num_scheduled_tokens)
            outputs.append(ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                             sampled_token_ids=[[token] for _ in rids], logprobs=None,
                                             prompt_logprobs_dict={}, pooler_output=None,
                                             kv_connector_output=kv_out))
        merged = self.aggregator.aggregate(outputs)
        assert merged is not None
        kv = merged.kv_connector_output
        # a request whose prefill is still chunked samples nothing this step
        merged.sampled_token_ids = [
            [token] if self._prompt_done(r) else [] for r in merged.req_ids
        ]
        result = StepResult(scheduled=dict(so.num_scheduled_tokens), outputs=[],
                            invalid_block_ids=set(kv.invalid_block_ids or ()) if kv else set(),
                            finished_recving=set(kv.finished_recving or ()) if kv else set(),
                            finished_sending=set(kv.finished_sending or ()) if kv else set(),
                            stats=kv.kv_connector_stats.data if kv and kv.kv_connector_stats else None)
        for eco in self.scheduler.update_from_output(so, merged).values():
            result.outputs.extend(eco.outputs)
        return result

    def _prompt_done(self, rid: str) -> bool:
        req = self.scheduler.requests.get(rid)
        return req is None or req.num_computed_tokens >= req.num_prompt_tokens

    def _forward(self, rank: Rank, scheduled: dict[str, int]) -> None:
        """The stand-in model: KV for every scheduled token, in the request's own blocks."""
        for rid, n in scheduled.items():
            req = self.scheduler.requests[rid]
            start = req.num_computed_tokens - n  # the scheduler already advanced it
            positions = torch.arange(start, start + n)
            tokens = torch.tensor(req.all_token_ids[start:start + n])
            blocks = torch.tensor(self.blocks_of(rid))[positions // BLOCK]
            offsets = positions % BLOCK
            for layer, name in enumerate(self.layer_names):
                t = rank.caches[name]
                t[blocks, :, offsets, :] = pattern(layer, rank.heads, positions, tokens)
            if rank is self.ranks[0]:
                self.computed.setdefault(rid, []).append((start, n))

    # --- what tests check -----------------------------------------------
    def kv_mismatch(self, rid: str, tokens: list[int], upto: int, *, skip_blocks: int = 0) -> str:
        """'' when positions [skip_blocks*BLOCK, upto) of the request hold the pattern on every rank, else what differs."""
        blocks = self.blocks_of(rid)
        positions = torch.arange(skip_blocks * BLOCK, upto)
        tok = torch.tensor(tokens[skip_blocks * BLOCK:upto])
        idx = torch.tensor(blocks)[positions // BLOCK]
        for r, rank in enumerate(self.ranks):
            for layer, name in enumerate(self.layer_names):
                got = rank.caches[name][idx, :, positions % BLOCK, :]
                want = pattern(layer, rank.heads, positions, tok)
                if not torch.equal(got, want):
                    bad = (got != want).nonzero()[0].tolist()
                    return f"rank {r} layer {layer}: position {int(positions[bad[0]])} head {bad[1]} differs"
        return ""

    def block_bytes(self, blocks: list[int]) -> list[torch.Tensor]:
        """Whole blocks (every byte, tails included) of every rank and layer, concatenated over heads."""
        idx = torch.tensor(blocks)
        per_layer = []
        for layer, name in enumerate(self.layer_names):
            per_layer.append(torch.cat([rank.caches[name][idx] for rank in self.ranks], dim=1).clone())
        return per_layer

    def fill_blocks(self, blocks: list[int], value: float) -> None:
        idx = torch.tensor(blocks)
        for rank in self.ranks:
            for t in rank.caches.values():
                t[idx] = value

    def close(self) -> None:
        for rank in self.ranks:
            rank.connector.shutdown()
        try:
            connector = self.scheduler.get_kv_connector()
        except AttributeError:
            connector = None
        if connector is not None:
            connector.shutdown()


def run_until(engines: list[VllmEngine], done: Callable[[], bool], *, steps: int = 400, wait_s: float = 0.005,
              on_step: Optional[Callable[[VllmEngine, StepResult], None]] = None) -> None:
    """Step every engine until ``done()``; between rounds wait a little on an event (reads run in threads)."""
    import threading

    pause = threading.Event()
    for _ in range(steps):
        for engine in engines:
            result = engine.step()
            if on_step is not None:
                on_step(engine, result)
        if done():
            return
        pause.wait(wait_s)
    raise AssertionError("engines did not reach the expected state")

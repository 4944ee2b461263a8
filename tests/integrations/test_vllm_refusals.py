"""What AtomKVConnector refuses, each with one line: bad ``kv_connector_extra_config``,
vLLM settings it does not support, and KV caches it cannot serve (refused at
``register_kv_caches``, and at the scheduler for the config's own groups); and
what it registers instead: each layer once, in the layout its attention
backend gives it."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable here; `make test-engines` runs these tests "
                                   "in their own environment (see docs/vllm.md)")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from atom_kv.config import ConfigError  # noqa: E402
from atom_kv.connector.kv_caches import describe_kv_caches  # noqa: E402
from atom_kv.integrations.vllm import (  # noqa: E402
    AtomKVConnector,
    UnsupportedKVCache,
    hooks_layers,
    kv_layout,
    kv_shape,
)
from tests.conftest import free_port  # noqa: E402
from tests.integrations.vllm_engine import (  # noqa: E402
    BLOCK,
    HEAD,
    StandInAttention,
    make_kv_cache_config,
    make_vllm_config,
    write_tiny_model,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def create(model_dir, role: str, extra: dict, *, side=KVConnectorRole.SCHEDULER, tp_size: int = 1,
           kv_cache_config=None):
    config = make_vllm_config(model_dir, role, extra, tp_size=tp_size)
    kv_cache_config = kv_cache_config or make_kv_cache_config(config, 32)
    return config, KVConnectorFactory.create_connector(config, side, kv_cache_config)


def base(**more) -> dict:
    return dict(handshake_port=free_port(), host_ip="127.0.0.1", **more)


@pytest.mark.parametrize("extra,message", [
    ({"handshake_prot": 7000},
     "kv-transfer-config: unknown key `handshake_prot`; did you mean `handshake_port`?"),
    ({"transfer_timeout_s": -1},
     "kv-transfer-config: `transfer_timeout_s` must be a positive number of seconds, got -1.0"),
    ({"backend": "rdma"},
     "kv-transfer-config: `backend` must be one of 'auto', 'tcp', 'cma', 'moriio', 'gpu_ipc', 'nixl', got 'rdma'"),
    ({"kv_role": "kv_consumer"},
     "kv_connector_extra_config: `kv_role` 'kv_consumer' contradicts vLLM's kv_role 'kv_producer'; "
     "set it once, as vLLM's kv_role"),
    ({"host_ip": ""},
     "kv_connector_extra_config: `host_ip` must be a host name or IP address, got ''"),
    ({"advertise_host": "127.0.0.2"},
     "kv_connector_extra_config: `host_ip` '127.0.0.1' and `advertise_host` '127.0.0.2' disagree; give one of them"),
    ({"advertise_host": "0.0.0.0"},
     "kv-transfer-config: `advertise_host` '0.0.0.0' is an unspecified address, which peers cannot dial; set it to "
     "this host's reachable address (`bind_host` may be 0.0.0.0)"),
    ({"idle_wait_ms": 1001},
     "kv_connector_extra_config: `idle_wait_ms` must be a number of milliseconds from 0 to 1000, got 1001"),
    ({"idle_wait_ms": "5"},
     "kv_connector_extra_config: `idle_wait_ms` must be a number of milliseconds from 0 to 1000, got '5'"),
    ({"proxy_ip": "127.0.0.1"},
     "kv_connector_extra_config: `http_port` is required with `proxy_ip` (set it to vLLM's --port, "
     "where the proxy sends requests)"),
    ({"proxy_ip": "127.0.0.1", "http_port": None},
     "kv_connector_extra_config: `http_port` is required with `proxy_ip` (set it to vLLM's --port, "
     "where the proxy sends requests)"),
])
def test_bad_extra_config_is_one_line_naming_the_key(model_dir, extra, message):
    with pytest.raises(ConfigError) as info:
        create(model_dir, "kv_producer", dict(base(), **extra))
    assert str(info.value) == message


def test_an_unspecified_host_ip_is_never_advertised(model_dir):
    with pytest.raises(ConfigError, match=r"the engine's address '0\.0\.0\.0' is an unspecified address.*"
                                          r"set `advertise_host` \(or the engine's own advertise setting: vLLM's "
                                          r"`host_ip`"):
        create(model_dir, "kv_producer", dict(base(), host_ip="0.0.0.0"))


def test_kv_both_is_refused(model_dir):
    with pytest.raises(ConfigError) as info:
        create(model_dir, "kv_both", base())
    assert str(info.value) == (
        "kv-transfer-config: `kv_role` 'kv_both' is not supported by AtomKVConnector; run prefill "
        "instances with 'kv_producer' and decode instances with 'kv_consumer'")


def test_kv_role_comes_from_vllm(model_dir):
    _, connector = create(model_dir, "kv_consumer", base())
    try:
        assert isinstance(connector, AtomKVConnector)
        assert connector.config.is_consumer
    finally:
        connector.shutdown()


def test_required_layout_is_hnd(model_dir):
    config = make_vllm_config(model_dir, "kv_producer", base())
    assert AtomKVConnector.get_required_kvcache_layout(config) == "HND"


def _groups_config(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=32, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)])


FULL = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=HEAD, dtype=torch.float32)
SLIDING = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=HEAD, dtype=torch.float32, sliding_window=64)
MAMBA = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))


@pytest.mark.parametrize("specs,needle", [
    ((FULL, SLIDING), "this model has 2 groups (FullAttentionSpec, SlidingWindowSpec): hybrid models"),
    ((MAMBA,), "AtomKVConnector serves full-attention and MLA KV caches; this model's KV cache is MambaSpec"),
    ((SLIDING,), "this model's KV cache is SlidingWindowSpec"),
])
@pytest.mark.parametrize("side", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_unservable_kv_cache_groups_are_refused(model_dir, specs, needle, side):
    cfg = _groups_config(*specs)
    if side == KVConnectorRole.SCHEDULER:
        with pytest.raises(UnsupportedKVCache) as info:
            create(model_dir, "kv_producer", base(), kv_cache_config=cfg)
    else:
        _, connector = create(model_dir, "kv_producer", base(), side=side, kv_cache_config=cfg)
        with pytest.raises(UnsupportedKVCache) as info:
            connector.register_kv_caches({})
        connector.shutdown()
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_nhd_caches_are_refused_at_register(model_dir):
    config, connector = create(model_dir, "kv_producer", base(), side=KVConnectorRole.WORKER)
    try:
        kv_cache_config = make_kv_cache_config(config, 32)
        config.cache_config.kv_cache_layout = "LBNHC"
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBNHC)
        with pytest.raises(UnsupportedKVCache) as info:
            connector.register_kv_caches(caches)
        assert "not laid out head-major per block (vLLM resolved the LBNHC layout)" in str(info.value)
        assert "needs HND (LBHNC)" in str(info.value)
    finally:
        connector.shutdown()


def test_other_kernel_block_size_is_refused_at_register(model_dir):
    config, connector = create(model_dir, "kv_producer", base(), side=KVConnectorRole.WORKER)
    try:
        kv_cache_config = make_kv_cache_config(config, 32)
        names = kv_cache_config.kv_cache_groups[0].layer_names
        caches = {n: torch.zeros(64, 2, BLOCK // 2, 2 * HEAD) for n in names}  # kernel blocks of 8 tokens
        with pytest.raises(UnsupportedKVCache) as info:
            connector.register_kv_caches(caches)
        assert "a kernel block size other than --block-size is not supported" in str(info.value)
    finally:
        connector.shutdown()


def test_more_tp_ranks_than_kv_heads_is_refused(model_dir):
    with pytest.raises(UnsupportedKVCache) as info:
        create(model_dir, "kv_producer", base(), tp_size=4)
    assert "2 KV heads over TP 4" in str(info.value)


@pytest.mark.parametrize("attention,layout", [
    ("CPU_ATTN", "vllm-cpu"), ("TRITON_ATTN", "vllm-hnd"), ("FLASH_ATTN", "vllm-hnd"), ("ROCM_AITER_FA", "vllm-hnd"),
    ("ROCM_AITER_UNIFIED_ATTN", "vllm-hnd"), ("FLEX_ATTENTION", "vllm-hnd"),
])
def test_each_layer_registers_once_in_its_backends_layout(model_dir, attention, layout):
    """Three fused layers are three ``kv`` tensors, each vLLM's own (no pairing, nothing read twice); the
    layout comes from the attention backend the model's layers run, and goes into the handshake."""
    config = make_vllm_config(model_dir, "kv_producer", base(), attention_backend=attention)
    kv_cache_config = make_kv_cache_config(config, 32)
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    try:
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        names = kv_cache_config.kv_cache_groups[0].layer_names
        assert kv_layout(config, names) == layout
        connector.register_kv_caches(caches)
        compat = connector.worker_side.hooks.compat
        assert compat.layout == layout and compat.num_layers == 3 and compat.head_dim == 2 * HEAD
        assert compat.num_kv_heads == 2 and compat.block_size == BLOCK and not compat.is_mla
        shape = kv_shape(config, kv_cache_config, 1)
        layers, _ = hooks_layers(shape, caches, names, layout=layout, resolved="LBHNC")
        described = describe_kv_caches(layers, compat, 1)
        assert [(t.layer, t.kind) for t in described] == [(0, "kv"), (1, "kv"), (2, "kv")]
        assert [t.tensor.data_ptr() for t in described] == [caches[n].data_ptr() for n in names]
        assert all(t.block_bytes == 2 * BLOCK * 2 * HEAD * 4 and t.num_blocks == 32 for t in described)
    finally:
        connector.shutdown()


def test_a_backend_vllm_derives_for_a_layer_kind_keeps_its_bases_layout(model_dir):
    """vLLM subclasses a backend per layer kind (chunked local attention, ...); the KV cache stays the base's."""
    from vllm.v1.attention.backend import subclass_attention_backend
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = make_vllm_config(model_dir, "kv_producer", base())
    names = make_kv_cache_config(config, 32).kv_cache_groups[0].layer_names
    derived = subclass_attention_backend("ChunkedLocalAttention_", CPUAttentionBackend,
                                         CPUAttentionBackend.get_builder_cls())
    for name in names:
        config.compilation_config.static_forward_context[name].backend = derived
    assert derived.__name__ == "ChunkedLocalAttention_CPUAttentionBackend"
    assert kv_layout(config, names) == "vllm-cpu"


@pytest.mark.parametrize("attention,needle", [
    ("ROCM_ATTN", "does not know how the ROCM_ATTN (RocmAttentionBackend) attention backend orders K and V"),
    (None, "this model's layers use attention backends with different ones"),
])
def test_backends_without_a_known_kv_order_are_refused_at_register(model_dir, attention, needle):
    config, connector = create(model_dir, "kv_producer", base(), side=KVConnectorRole.WORKER)
    try:
        names = make_kv_cache_config(config, 32).kv_cache_groups[0].layer_names
        if attention is None:  # one layer on another backend than the others
            config.compilation_config.static_forward_context[names[1]] = StandInAttention("TRITON_ATTN")
        else:
            for name in names:
                config.compilation_config.static_forward_context[name] = StandInAttention(attention)
        caches = allocate_kv_cache(make_kv_cache_config(config, 32), torch.device("cpu"), KVCacheLayout.LBHNC)
        with pytest.raises(UnsupportedKVCache) as info:
            connector.register_kv_caches(caches)
        assert needle in str(info.value) and "\n" not in str(info.value)
        assert connector.worker_side.hooks is None
    finally:
        connector.shutdown()


def test_no_attention_layers_and_no_backend_vllm_can_name_is_refused(model_dir, monkeypatch):
    import vllm.distributed.kv_transfer.kv_connector.utils as kv_utils

    def no_backend(*args, **kwargs):  # vLLM's selector on a platform without a default backend
        raise ValueError("Invalid attention backend for cpu")

    config, connector = create(model_dir, "kv_producer", base(), side=KVConnectorRole.WORKER)
    try:
        config.compilation_config.static_forward_context.clear()
        monkeypatch.setattr(kv_utils, "get_current_attn_backends", no_backend)
        caches = allocate_kv_cache(make_kv_cache_config(config, 32), torch.device("cpu"), KVCacheLayout.LBHNC)
        with pytest.raises(UnsupportedKVCache) as info:
            connector.register_kv_caches(caches)
        assert str(info.value).startswith("AtomKVConnector cannot tell which attention backend reads this "
                                          "engine's KV cache (")
        assert "\n" not in str(info.value)
    finally:
        connector.shutdown()


def test_mla_caches_register_one_latent_tensor_per_layer(model_dir):
    """MLA layers keep one latent row per token (replicated over TP ranks): registered as such."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, MLAAttentionSpec

    config = make_vllm_config(model_dir, "kv_producer", base())
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    page = spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=32, kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        kv_cache_tensors=[KVCacheTensor(size=page * 32 * 3, layers=names, layer_stride=page * 32, block_stride=page)])
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    try:
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        assert list(next(iter(caches.values())).shape) == [32, 1, BLOCK, 64]
        connector.register_kv_caches(caches)
        compat = connector.worker_side.hooks.compat
        assert compat.is_mla and compat.num_layers == 3 and compat.head_dim == 64 and compat.num_kv_heads == 1
    finally:
        connector.shutdown()

"""Pure logic of the moriio backend: config mapping, read planning, session
caching, error mapping and the availability checks. No threads, no fake
engine except where a test says so."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from atom_kv.config import KVTransferConfig
from atom_kv.transfer import BackendUnavailable, ReadOp, TransferError, create_backend
from atom_kv.transfer.moriio.plan import (
    SessionCache,
    build_rdma_config,
    code_name,
    plan_reads,
    rdma_config_attrs,
    status_error,
)
from atom_kv.transfer.moriio.probe import (
    describe_import_error,
    load_mori,
    rdma_device_problem,
    resolve,
    unavailable_reason,
)
from tests.transfer.fake_mori import use_real


def cfg(**kw) -> KVTransferConfig:
    return KVTransferConfig.from_dict({"kv_role": "kv_consumer", **kw})


# --------------------------------------------------------------------------
# config -> RdmaBackendConfig
# --------------------------------------------------------------------------
def test_rdma_attrs_defaults_leave_max_keys_to_library():
    attrs = rdma_config_attrs(cfg(), {})
    assert attrs == {  # ATOM's defaults
        "qp_per_transfer": 4,
        "post_batch_size": -1,
        "num_worker_threads": 4,
        "poll_cq_mode": "POLLING",
        "enable_notification": False,
    }


def test_rdma_attrs_carry_every_key_that_is_set():
    attrs = rdma_config_attrs(
        cfg(qp_per_transfer=4, post_batch_size=8, num_worker_threads=3, moriio={"poll_cq_mode": "event"},
            enable_notification=True, max_send_wr=512, max_cqe_num=4096, max_msg_sge=2),
        {},
    )
    assert attrs == {
        "qp_per_transfer": 4,
        "post_batch_size": 8,
        "num_worker_threads": 3,
        "poll_cq_mode": "EVENT",
        "enable_notification": True,
        "max_send_wr": 512,
        "max_cqe_num": 4096,
        "max_msg_sge": 2,
    }


class _Poll:
    POLLING = "poll-enum"
    EVENT = "event-enum"


class _NewConfig:
    __slots__ = ("qp_per_transfer", "post_batch_size", "num_worker_threads", "poll_cq_mode",
                 "enable_notification", "max_send_wr", "max_cqe_num", "max_msg_sge")


class _OldConfig:
    """An older RdmaBackendConfig without the max_* attributes."""

    __slots__ = ("qp_per_transfer", "post_batch_size", "num_worker_threads", "poll_cq_mode", "enable_notification")


class _BrokenConfig:
    __slots__ = ("qp_per_transfer",)


def test_mori_env_vars_apply_only_to_keys_left_at_default():
    env = {"MORI_IO_QP_PER_TRANSFER": "8", "MORI_IO_POLL_CQ_MODE": "event", "MORI_IO_POST_BATCH_SIZE": ""}
    attrs = rdma_config_attrs(cfg(), env)
    assert "qp_per_transfer" not in attrs and "poll_cq_mode" not in attrs
    assert attrs["post_batch_size"] == -1  # empty variable counts as unset
    attrs = rdma_config_attrs(cfg(qp_per_transfer=2, moriio={"poll_cq_mode": "event"}), env)
    assert attrs["qp_per_transfer"] == 2 and attrs["poll_cq_mode"] == "EVENT"


def test_build_rdma_config_sets_attributes_and_enum():
    obj, skipped = build_rdma_config(_NewConfig, _Poll, cfg(moriio={"poll_cq_mode": "event"}, qp_per_transfer=2, max_cqe_num=9), {})
    assert skipped == []
    assert obj.poll_cq_mode == "event-enum"
    assert obj.qp_per_transfer == 2
    assert obj.max_cqe_num == 9
    assert not hasattr(obj, "max_send_wr")  # 0 -> not set, library default kept


def test_build_rdma_config_skips_optional_attrs_an_old_mori_lacks():
    obj, skipped = build_rdma_config(_OldConfig, _Poll, cfg(max_send_wr=64, max_msg_sge=4), {})
    assert skipped == ["max_send_wr", "max_msg_sge"]
    assert obj.poll_cq_mode == "poll-enum"


def test_build_rdma_config_rejects_missing_core_attr():
    with pytest.raises(TransferError, match="post_batch_size"):
        build_rdma_config(_BrokenConfig, _Poll, cfg(), {})


# --------------------------------------------------------------------------
# planning: merge, bounds, group per session
# --------------------------------------------------------------------------
LOCAL = [4096, 4096]
REMOTE = [4096, 4096, 1024]


def test_plan_groups_merged_ranges_per_region_pair():
    ops = [
        ReadOp(0, 0, 1, 0, 256),
        ReadOp(0, 256, 1, 256, 256),  # contiguous with the first -> merged
        ReadOp(0, 1024, 1, 2048, 128),  # same pair, not contiguous
        ReadOp(1, 0, 2, 0, 512),  # another pair
        ReadOp(0, 3000, 0, 100, 10),  # a third pair
    ]
    batches = {(b.local_region, b.remote_region): b for b in plan_reads(ops, LOCAL, REMOTE, "p")}
    assert set(batches) == {(0, 1), (1, 2), (0, 0)}
    b = batches[(0, 1)]
    assert (b.local_offsets, b.remote_offsets, b.sizes) == ([0, 1024], [0, 2048], [512, 128])
    assert batches[(1, 2)].sizes == [512]
    assert batches[(0, 0)].local_offsets == [3000] and batches[(0, 0)].remote_offsets == [100]
    assert sum(b.nbytes for b in batches.values()) == sum(o.size for o in ops)


def test_plan_accepts_a_generator_and_an_op_array():
    ops = (ReadOp(0, i * 64, 0, i * 64, 64) for i in range(4))
    (batch,) = plan_reads(ops, LOCAL, REMOTE, "p")
    assert batch.sizes == [256]
    arr = np.array([[0, 0, 1, 64, 32], [0, 32, 1, 96, 32], [1, 0, 0, 0, 8]], dtype=np.int64)
    batches = plan_reads(arr, LOCAL, REMOTE, "p")
    assert [(b.local_region, b.remote_region, b.sizes) for b in batches] == [(1, 0, [8]), (0, 1, [64])]
    assert all(type(x) is int for b in batches for x in b.remote_offsets)


@pytest.mark.parametrize(
    "op, words",
    [
        (ReadOp(0, 0, 2, 1000, 25), ["remote range [1000, 1025) is outside remote region 2 of peer p (1024 bytes)"]),
        (ReadOp(1, 4090, 0, 0, 7), ["local range [4090, 4097) is outside local region 1 (4096 bytes)"]),
        (ReadOp(2, 0, 0, 0, 8), ["local region 2 is outside the 2 regions this engine registered"]),
        (ReadOp(0, 0, 3, 0, 8), ["remote region 3 is outside the 3 regions peer p registered"]),
        (ReadOp(0, -8, 0, 0, 8), ["local range [-8, 0) is outside local region 0"]),
        (ReadOp(0, 0, 0, -1, 8), ["remote range [-1, 7) is outside remote region 0"]),
        (ReadOp(0, 0, 0, 0, 0), ["non-positive size"]),
    ],
)
def test_plan_rejects_out_of_bounds_ops(op, words):
    good = ReadOp(0, 0, 0, 0, 16)
    with pytest.raises(TransferError) as info:
        plan_reads([good, op], LOCAL, REMOTE, "p")
    for w in words:
        assert w in str(info.value)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------
# session cache
# --------------------------------------------------------------------------
def test_session_cache_creates_lazily_reuses_and_drops_per_peer():
    made = []

    def factory(tag):
        def make():
            made.append(tag)
            return object()
        return make

    cache = SessionCache()
    assert len(cache) == 0 and made == []
    s1 = cache.get("a", 0, 1, factory("a01"))
    assert cache.get("a", 0, 1, factory("again")) is s1
    s2 = cache.get("a", 1, 1, factory("a11"))
    s3 = cache.get("b", 0, 1, factory("b01"))
    assert made == ["a01", "a11", "b01"] and len({id(s1), id(s2), id(s3)}) == 3
    assert cache.drop_peer("a") == 2
    assert cache.keys() == [("b", 0, 1)]
    assert cache.get("a", 0, 1, factory("a01-new")) is not s1
    assert made[-1] == "a01-new"
    assert cache.created == 4


def test_session_cache_failed_create_is_an_error_and_not_cached():
    cache = SessionCache()
    with pytest.raises(TransferError, match="could not create a session from local region 3 to remote region 4 of peer x"):
        cache.get("x", 3, 4, lambda: None)
    assert len(cache) == 0


# --------------------------------------------------------------------------
# error mapping
# --------------------------------------------------------------------------
class _Code:
    def __init__(self, name, value):
        self.name, self.value = name, value

    def __int__(self):
        return self.value


def test_status_error_names_code_message_and_where():
    (batch,) = plan_reads([ReadOp(1, 0, 2, 0, 100)], LOCAL, REMOTE, "peer9")
    text = status_error(_Code("ERR_RDMA_OP", 5), "remote access\nerror", peer="peer9", batch=batch)
    assert text == (
        "MORI-IO transfer failed: ERR_RDMA_OP (5): remote access error "
        "(peer peer9, local region 1 <- remote region 2, 100 bytes)"
    )
    assert code_name(7) == "7"
    assert "no message" in status_error(3, "", peer="p")


def test_import_error_without_mori_suggests_install_and_tcp():
    text = describe_import_error(ModuleNotFoundError("No module named 'mori'", name="mori"))
    assert text.startswith("No module named 'mori'")
    assert "pip install 'atom-kv[mori]'" in text and "ROCm 7" in text and '"backend": "tcp"' in text


@pytest.mark.parametrize(
    "exc",
    [
        OSError("libamdhip64.so.7: cannot open shared object file: No such file or directory"),
        ImportError("libhsa-runtime64.so.1: cannot open shared object file"),
    ],
)
def test_import_error_from_missing_rocm_names_the_runtime(exc):
    text = describe_import_error(exc)
    assert text.startswith("the ROCm runtime library could not be loaded")
    assert str(exc) in text


def test_other_import_errors_are_one_line_with_type():
    text = describe_import_error(RuntimeError("hip init\nfailed"))
    assert text.startswith("importing mori.io failed: RuntimeError: hip init failed")


def _raiser(exc):
    def import_fn(name):
        raise exc
    return import_fn


def test_load_mori_turns_import_failure_into_one_line_unavailable(tmp_path):
    with pytest.raises(BackendUnavailable) as info:
        load_mori(_raiser(OSError("libamdhip64.so.7: cannot open shared object file\nmore")), sysfs_dir=str(tmp_path))
    text = str(info.value)
    assert text.startswith("MORI-IO unavailable: the ROCm runtime library")
    assert "\n" not in text


class _Module:
    pass


def test_rdma_needs_a_device_but_xgmi_does_not(tmp_path):
    fake = _Module()
    reason = unavailable_reason(lambda name: fake, transport="rdma", sysfs_dir=str(tmp_path / "none"))
    assert reason.startswith("MORI-IO unavailable: no RDMA device found under")
    assert '"moriio": {"transport": "xgmi"}' in reason
    assert load_mori(lambda name: fake, transport="xgmi", sysfs_dir=str(tmp_path / "none")) is fake


def test_rdma_device_checks_honour_mori_rdma_devices(tmp_path):
    for dev in ("mlx5_0", "rdma1"):
        (tmp_path / dev).mkdir()
    assert rdma_device_problem(str(tmp_path), {}) is None
    assert rdma_device_problem(str(tmp_path), {"MORI_RDMA_DEVICES": "mlx5_0, rdma1:1"}) is None
    assert rdma_device_problem(str(tmp_path), {"MORI_RDMA_DEVICES": "^mlx5_0"}) is None
    problem = rdma_device_problem(str(tmp_path), {"MORI_RDMA_DEVICES": "mlx5_0,bnxt_re7"})
    assert problem.startswith("MORI_RDMA_DEVICES names bnxt_re7 but the devices under")
    assert "mlx5_0, rdma1" in problem
    fake = _Module()
    reason = unavailable_reason(lambda n: fake, sysfs_dir=str(tmp_path), environ={"MORI_RDMA_DEVICES": "nope0"})
    assert reason.startswith("MORI-IO unavailable: MORI_RDMA_DEVICES names nope0")


def test_resolve_falls_back_to_mori_cpp():
    io, cpp = _Module(), _Module()
    io.IOEngine = "io-engine"
    cpp.PollCqMode = "cpp-poll"
    modules = {"mori.cpp": cpp}
    assert resolve(io, "IOEngine", modules.__getitem__) == "io-engine"
    assert resolve(io, "PollCqMode", modules.__getitem__) == "cpp-poll"
    with pytest.raises(BackendUnavailable, match="^MORI-IO unavailable: this mori version has no Missing"):
        resolve(io, "Missing", modules.__getitem__)


# --------------------------------------------------------------------------
# the real thing is absent here
# --------------------------------------------------------------------------
def test_create_backend_without_mori_is_one_line_unavailable():
    use_real()  # make sure the fake is not importable in this process
    try:
        import mori  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("a real mori is installed on this machine")
    with pytest.raises(BackendUnavailable) as info:
        create_backend("moriio", cfg(backend="moriio"), host="127.0.0.1", key="e0-dp0-tp0")
    text = str(info.value)
    assert text.startswith("MORI-IO unavailable:")
    assert "No module named 'mori'" in text and "pip install 'atom-kv[mori]'" in text
    assert "\n" not in text
    assert "mori" not in sys.modules


def test_plan_matches_the_reference_merge_on_random_ops():
    from atom_kv.transfer import merge_ops

    rng = np.random.default_rng(5)
    block = 64
    ops = []
    for _ in range(400):
        lr, rr = int(rng.integers(0, 2)), int(rng.integers(0, 3))
        nblocks = (LOCAL[lr] if lr < 2 else 0) // block, REMOTE[rr] // block
        lb, rb = int(rng.integers(0, nblocks[0])), int(rng.integers(0, nblocks[1]))
        ops.append(ReadOp(lr, lb * block, rr, rb * block, block))
    ops += [ReadOp(0, i * block, 1, i * block, block) for i in range(10)]  # a mergeable run
    got = sorted(
        (b.local_region, lo, b.remote_region, ro, n)
        for b in plan_reads(ops, LOCAL, REMOTE, "p")
        for lo, ro, n in zip(b.local_offsets, b.remote_offsets, b.sizes)
    )
    want = sorted(tuple(op) for op in merge_ops(ops))
    assert got == want
    assert len(got) < len(ops)

"""P/D scenarios run against the fake ATOM (the contract test) and ATOM itself (ATOM_SRC).

Each builds a producer and a consumer ``AtomEngine`` (``atom_pd``), runs
requests through both the way ATOM and a proxy would, and checks the outputs,
every prompt KV byte on every consumer rank, and that every block of both
engines is free and no connector work is left at the end.
"""

from __future__ import annotations

import logging
import time

from atom.model_engine.sequence import SequenceStatus

from atom_kv.integrations.atom.sequences import SeqState
from atom_kv.transfer import BackendUnavailable, create_backend
from tests.conftest import free_port
from tests.connector.kvutil import port_range
from tests.integrations.atom_pd import AtomEngine, decode_params, expected_output, prefill_on, run_until

def cma_unavailable() -> str:
    """Why the same-host backend cannot run here ('' when it can)."""
    try:
        create_backend("cma").close()
        return ""
    except BackendUnavailable as exc:
        return str(exc)


PROMPTS = [list(range(5, 12)), list(range(30, 46)), list(range(100, 140))]  # 7, 16 (one full block) and 40 tokens


def _engines(p_tp: int, d_tp: int, backend: str, *, p_kv: dict | None = None, d_kv: dict | None = None,
             p_blocks: int = 64, **both) -> tuple[AtomEngine, AtomEngine]:
    """A producer (seed 1) and a consumer (seed 2) engine: the consumer can tell read KV from its own."""
    P = AtomEngine("P", "kv_producer", tp=p_tp, port=port_range(p_tp), seed=1, backend=backend,
                   num_blocks=p_blocks, **both, **(p_kv or {}))
    try:
        D = AtomEngine("D", "kv_consumer", tp=d_tp, port=port_range(d_tp), seed=2, backend=backend,
                       **both, **(d_kv or {}))
    except BaseException:
        P.close()
        raise
    D.remote_seed = P.seed
    return P, D


def exchange(p_tp: int, d_tp: int, backend: str, **layout) -> None:
    """Prefill on P, read on D, decode on D: outputs as if colocated, every block freed on both.

    ``layout``: ``mla=True``, ``fp8=True`` (with per-token scales), ``block_size=32`` (two physical blocks).
    """
    P, D = _engines(p_tp, d_tp, backend, **layout)
    try:
        prefilled = prefill_on(P, PROMPTS)
        assert P.blocks_in_use() > 0  # held for the readers
        dseqs = [D.add(p, 4, decode_params(s)) for p, s in zip(PROMPTS, prefilled)]
        run_until([P, D], lambda: all(s.id in D.finished for s in dseqs) and P.idle() and D.idle())
        assert D.errors == [], D.errors
        for prompt, seq in zip(PROMPTS, dseqs):
            assert seq.leave_reason == "max_tokens" and seq.output_tokens == expected_output(prompt, 4)
            assert seq.id not in D.prefilled  # its prompt KV was read, not recomputed
    finally:
        P.close()
        D.close()


def pp_exchange(p_tp: int, d_tp: int, backend: str = "tcp", pp: int = 2, layers: int = 4, **layout) -> None:
    """A prefill engine in ``pp`` pipeline stages (ATOM's ``-pp``), a decode engine in one: every stage's
    ranks listen on their stage's ports and lend their own layers, the decode ranks read each layer from
    the stage that holds it; outputs as if colocated (and as with one stage), every block freed on both."""
    P = AtomEngine("P", "kv_producer", tp=p_tp, port=port_range(pp * p_tp), seed=1, backend=backend, pp=pp,
                   layers=layers, **layout)
    try:
        D = AtomEngine("D", "kv_consumer", tp=d_tp, port=port_range(d_tp), seed=2, backend=backend, layers=layers,
                       **layout)
    except BaseException:
        P.close()
        raise
    D.remote_seed = P.seed
    try:
        per = layers // pp
        for s, stage in enumerate(P.stages):  # each stage holds its slice of the model, keyed as ATOM keys it
            assert [r.global_layers for r in stage] == [range(s * per, layers if s == pp - 1 else (s + 1) * per)] * p_tp
        prefilled = prefill_on(P, PROMPTS)
        assert all(s.kv_transfer_params_output["remote_pp_size"] == pp for s in prefilled)
        assert P.blocks_in_use() > 0  # held for the readers
        dseqs = [D.add(p, 4, decode_params(s)) for p, s in zip(PROMPTS, prefilled)]
        run_until([P, D], lambda: all(s.id in D.finished for s in dseqs) and P.idle() and D.idle())
        assert D.errors == [], D.errors  # every layer's KV is the producer's, on every decode rank
        for prompt, seq in zip(PROMPTS, dseqs):
            assert seq.leave_reason == "max_tokens" and seq.output_tokens == expected_output(prompt, 4)
            assert seq.id not in D.prefilled  # its prompt KV was read, not recomputed
        for s, stage in enumerate(P.stages):  # every stage was read from and told so
            assert sum(r.worker.stats().get("done_received", 0) for r in stage) >= len(PROMPTS), s
        assert P.blocks_in_use() == 0 and D.blocks_in_use() == 0
    finally:
        P.close()
        D.close()


def pp_refusals() -> list[str]:
    """What a pipeline set-up atom-kv cannot serve is told, one line each: a decode engine in stages, a stage
    whose caches are not named by their model layer."""
    from atom_kv.config import ConfigError
    from atom_kv.connector.cache_layouts import LayoutMismatch

    lines = []
    try:
        AtomEngine("D", "kv_consumer", tp=1, port=port_range(2), seed=2, pp=2)
    except ConfigError as exc:
        lines.append(str(exc))
    from atom_kv.integrations.atom.caches import stage_first_layer

    for names in (["layer_2", "layer_4"], ["attn.0", "attn.1"], ["layer_3", "layer_4"]):
        try:
            stage_first_layer(names, 4)
        except LayoutMismatch as exc:
            lines.append(str(exc))
    return lines


def _dead_params(prompt_len: int, block_size: int = 16) -> dict:
    port = free_port()  # nothing listens: the handshake cannot complete
    blocks = -(-prompt_len // block_size)
    return dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id="gone", remote_host="127.0.0.1",
                remote_port=port, remote_handshake_port=port, remote_block_ids=list(range(blocks)),
                remote_tp_size=1, transfer_id="gone-1", first_token_id=7)


def failed_load(policy: str, d_tp: int = 2) -> None:
    """A load that cannot complete: ``recompute`` prefills locally, ``fail`` ends the request; blocks freed."""
    D = AtomEngine("D", "kv_consumer", tp=d_tp, port=port_range(d_tp), seed=2, load_failure_policy=policy,
                   handshake_timeout_s=0.3)
    try:
        prompt = PROMPTS[2]
        seq = D.add(prompt, 3, _dead_params(len(prompt)))
        run_until([D], lambda: seq.id in D.finished and D.idle(), timeout_s=20)
        assert D.errors == [], D.errors
        if policy == "recompute":
            assert seq.leave_reason == "max_tokens" and seq.output_tokens == expected_output(prompt, 3)
            assert seq.id in D.prefilled
        else:
            assert seq.leave_reason == "aborted" and seq.output_tokens == []
            assert seq.id not in D.prefilled
    finally:
        D.close()


def abort_while_loading(d_tp: int = 2) -> None:
    """The client goes away while the load runs: the request ends, its blocks come back once no rank writes them."""
    D = AtomEngine("D", "kv_consumer", tp=d_tp, port=port_range(d_tp), seed=2, handshake_timeout_s=2.0)
    try:
        prompt = PROMPTS[2]
        seq = D.add(prompt, 3, _dead_params(len(prompt)))
        run_until([D], lambda: seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS)
        for _ in range(3):  # the load's metadata reached every rank: their reads are running
            D.step()
        assert D.blocks_in_use() == 3
        D.abort(seq)
        run_until([D], lambda: seq.id in D.finished)
        assert seq.leave_reason == "aborted"
        assert D.blocks_in_use() == 3  # a rank may still be writing them
        run_until([D], D.idle, timeout_s=20)
        assert seq.id not in D.prefilled and D.errors == []
    finally:
        D.close()


def _holds_nothing(engine: AtomEngine) -> None:
    """The connector keeps no per-request state once every request has ended."""
    c = engine.connector
    held = {sid: state for sid, state in c._seqs.states().items() if state is not SeqState.LOCAL}
    assert not held, held
    assert c._hooks.num_loads() == 0 and not c.has_pending_work()


def aborted_while_queued(rounds: int = 3, release_within_s: float = 2.0, upstream: bool = False) -> None:
    """Decode requests aborted while still queued, before ATOM asked the connector anything (ATOM ends them
    in ``schedule()`` and tells no connector), and one aborted after its load finished but before its first
    decode (ATOM keeps its id in ``finished_recving_kv_req_ids``): every prefill block comes back within
    ``release_within_s`` (the lease is 30 s), every consumer block is freed, and the consumer's connector
    keeps nothing of them, round after round. ``upstream``: the fake ATOM with docs/atom-upstream.md, which
    hands the connector its BlockManager and reports those requests itself (nothing of ATOM is wrapped)."""
    P, D = _engines(1, 1, "tcp", d_kv={"upstream": True} if upstream else None)
    assert ("take_rejected" in vars(D.sched)) is not upstream  # ATOM main: the connector watches take_rejected()
    try:
        for _ in range(rounds):
            prefilled = prefill_on(P, PROMPTS)
            assert P.blocks_in_use() > 0  # held for the readers, for up to abort_timeout_s (30 s)
            queued = [D.add(p, 3, decode_params(s)) for p, s in zip(PROMPTS[:2], prefilled[:2])]
            for seq in queued:
                D.abort(seq)  # the client left before the decode engine's scheduler ran
            start = time.monotonic()
            run_until([P, D], lambda: all(s.id in D.finished for s in queued) and P.blocks_in_use() == 3,
                      timeout_s=release_within_s)
            assert time.monotonic() - start < release_within_s
            for seq in queued:
                assert seq.leave_reason == "aborted" and seq.output_tokens == [] and seq.id not in D.prefilled
            loaded = D.add(PROMPTS[2], 3, decode_params(prefilled[2]))
            run_until([P, D], lambda: loaded.id in D.sched.finished_recving_kv_req_ids)
            D.abort(loaded)  # the load is done, its first decode not scheduled yet
            run_until([P, D], lambda: loaded.id in D.finished and P.idle() and D.idle(), timeout_s=10)
            assert loaded.leave_reason == "aborted" and D.errors == [], D.errors
            _holds_nothing(D)
            _holds_nothing(P)
    finally:
        P.close()
        D.close()


def lease_expiry(backend: str = "tcp") -> None:
    """Nobody reads: the producer frees the blocks after ``abort_timeout_s`` and reuses them; a consumer that
    reads afterwards is told its read is invalid and recomputes instead of decoding another request's KV."""
    prompt_a, prompt_b = list(range(200, 248)), list(range(300, 348))  # 3 blocks each; the producer has 3
    P, D = _engines(1, 1, backend, p_kv={"abort_timeout_s": 0.5}, d_kv={"load_failure_policy": "recompute"},
                    p_blocks=3)
    try:
        (a,) = prefill_on(P, [prompt_a])
        run_until([P], P.idle, timeout_s=10)  # the lease expired: A's blocks are free again
        (b,) = prefill_on(P, [prompt_b])      # B's prefill overwrote them
        late = D.add(prompt_a, 3, decode_params(a))
        run_until([P, D], lambda: late.id in D.finished and D.idle() and P.idle(), timeout_s=20)
        assert D.errors == [], D.errors
        assert late.leave_reason == "max_tokens" and late.output_tokens == expected_output(prompt_a, 3)
        assert late.id in D.prefilled  # recomputed: the read was refused
    finally:
        P.close()
        D.close()


def prefix_hit(backend: str = "tcp") -> None:
    """A decode engine with prefix caching (ATOM's default) reads only the blocks past its local hit: the
    cached blocks keep its own KV, the rest is the producer's."""
    shared = list(range(400, 448))                 # 3 blocks both requests start with
    P, D = _engines(1, 2, backend, prefix_caching=True)
    try:
        first = D.add(shared + [7, 8], 2)          # computed on D: its blocks enter D's prefix cache
        run_until([D], lambda: first.id in D.finished and D.idle())
        prompt = shared + list(range(500, 540))    # 88 tokens: 3 blocks cached on D, 3 to read
        (prefilled,) = prefill_on(P, [prompt])
        seq = D.add(prompt, 3, decode_params(prefilled))
        run_until([P, D], lambda: seq.id in D.finished and D.idle() and P.idle())
        assert D.cached_at_alloc[seq.id] == 48, D.cached_at_alloc
        assert D.errors == [], D.errors           # cached positions carry D's KV, the others P's
        assert seq.id not in D.prefilled and seq.output_tokens == expected_output(prompt, 3)
    finally:
        P.close()
        D.close()


def layout_mismatch(backend: str = "tcp") -> list[str]:
    """A decode engine with another KV layout (ATOM 0c982ea92's V, ``aiter``) than the prefill engine
    (ATOM main's shuffled V, ``aiter-shuffle``): the handshake refuses, nothing is read, the request is
    recomputed. Returns the decode engine's log lines that give the reason."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logging.getLogger("atom_kv").addHandler(handler)
    P, D = _engines(1, 1, backend, d_kv={"load_failure_policy": "recompute", "shuffled_v": False})
    try:
        prompt = PROMPTS[2]
        (prefilled,) = prefill_on(P, [prompt])
        seq = D.add(prompt, 3, decode_params(prefilled))
        run_until([P, D], lambda: seq.id in D.finished and D.idle() and P.idle())
        assert D.errors == [] and seq.id in D.prefilled
        assert seq.output_tokens == expected_output(prompt, 3)
        return [line for line in lines if "KV layout mismatch" in line]
    finally:
        logging.getLogger("atom_kv").removeHandler(handler)
        P.close()
        D.close()


def dp_exchange(p_dp: int, d_dp: int, p_tp: int = 1, d_tp: int = 1, backend: str = "tcp") -> None:
    """DP-attention engines on both sides: one ATOM scheduler per DP rank, the ranks of
    each side sharing one base handshake port (ATOM's port layout). Request ``i`` is
    prefilled on prefill rank ``i % p_dp`` and decoded on decode rank ``(i + 1) % d_dp``;
    each prefill rank holds exactly its own requests' blocks until its reader is done,
    every decode rank checks it read the KV of the prefill rank (its own seed) that
    computed the prompt, and every rank of both sides ends with every block free."""
    p_port, d_port = port_range(p_dp * p_tp), port_range(d_dp * d_tp)
    Ps: list[AtomEngine] = []
    Ds: list[AtomEngine] = []
    try:
        for r in range(p_dp):
            Ps.append(AtomEngine(f"P{r}", "kv_producer", tp=p_tp, port=p_port, seed=1 + 2 * r, backend=backend,
                                 dp_rank=r, dp_size=p_dp))
        for r in range(d_dp):
            Ds.append(AtomEngine(f"D{r}", "kv_consumer", tp=d_tp, port=d_port, seed=100 + r, backend=backend,
                                 dp_rank=r, dp_size=d_dp))
        prompts = PROMPTS + [list(range(600, 633))]
        on_p = [i % p_dp for i in range(len(prompts))]
        on_d = [(i + 1) % d_dp for i in range(len(prompts))]
        prefilled = {}
        for r, P in enumerate(Ps):
            mine = [i for i in range(len(prompts)) if on_p[i] == r]
            for i, seq in zip(mine, prefill_on(P, [prompts[i] for i in mine])):
                prefilled[i] = seq
                assert seq.kv_transfer_params_output["dp_rank"] == r
                assert seq.kv_transfer_params_output.get("remote_dp_size", 1) == p_dp
            # held for the readers: exactly this rank's requests' blocks
            assert P.blocks_in_use() == sum(-(-len(prompts[i]) // 16) for i in mine), (r, P.blocks_in_use())
        dseqs = []
        for i, prompt in enumerate(prompts):
            D = Ds[on_d[i]]
            seq = D.add(prompt, 4, decode_params(prefilled[i]))
            D.remote_seed_of[seq.id] = Ps[on_p[i]].seed
            dseqs.append((D, seq))
        everyone = Ps + Ds
        run_until(everyone, lambda: all(s.id in D.finished for D, s in dseqs) and all(e.idle() for e in everyone))
        for D in Ds:
            assert D.errors == [], D.errors
        for prompt, (D, seq) in zip(prompts, dseqs):
            assert seq.output_tokens == expected_output(prompt, 4) and seq.id not in D.prefilled
        assert all(e.blocks_in_use() == 0 for e in everyone)
    finally:
        for e in Ps + Ds:
            e.close()
